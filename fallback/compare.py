"""Compare two engines' outputs for shadow and dual-run logs (pure functions).

* Both outputs JSON objects (the rules' intent and the model's schema-constrained answer):
  field by field. Nested objects are flattened to dotted paths (``sensor.id``); a field
  present on one side only disagrees. Strings agree after normalising (``fallback.text``:
  NFKC, ASCII quotes, lowercase, whitespace collapsed, ends stripped); numbers agree by value
  (21 == 21.0); booleans only equal booleans; lists and nulls compare element-wise with the
  same rules.
  ``ratio`` = agreeing fields / fields on either side (1.0 for two empty objects).
* Otherwise, text: ``agree`` is an exact match after the same normalisation, and ``ratio`` is
  the token-overlap F1 of the two bags of words, as in the SQuAD v1.1 evaluation script
  (Rajpurkar et al. 2016, ``f1_score``): precision and recall of shared tokens, their harmonic
  mean. When only one side is a JSON object, the comparison is ``mixed``: they disagree on
  every field of the JSON side and ``ratio`` is that text F1 of the raw strings.

Model output is read leniently as JSON: surrounding whitespace and a Markdown code fence
(```json ... ```) are removed first, because base models like to add them.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from fallback.text import normalise_text as normalise

_FENCE = "```"
_TOKEN = re.compile(r"\w+")


@dataclass(frozen=True)
class Comparison:
    """How two outputs compare.

    Attributes:
        kind: ``json`` (both JSON objects), ``text`` (neither) or ``mixed`` (one of each).
        agree: the outputs are the same after normalisation (every field, or the whole text).
        ratio: in [0, 1]; agreeing fields / all fields (json) or token F1 (text, mixed).
        fields: every field compared (json), or the JSON side's fields (mixed), sorted.
        disagree: the fields that differ or exist on one side only, sorted.
    """

    kind: str
    agree: bool
    ratio: float
    fields: tuple[str, ...] = ()
    disagree: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form for the JSON Lines logs."""
        return {
            "kind": self.kind,
            "agree": self.agree,
            "ratio": round(self.ratio, 4),
            "fields": list(self.fields),
            "disagree": list(self.disagree),
        }


def compare_outputs(a: str, b: str) -> Comparison:
    """Compare two output texts, as JSON objects where both parse as one (see the module doc)."""
    obj_a, obj_b = parse_json_object(a), parse_json_object(b)
    if obj_a is not None and obj_b is not None:
        return compare_json(obj_a, obj_b)
    if obj_a is None and obj_b is None:
        return compare_text(a, b)
    fields = tuple(sorted(flatten(obj_a if obj_a is not None else obj_b or {})))
    return Comparison("mixed", False, token_f1(a, b), fields, fields)


def compare_json(a: dict[str, Any], b: dict[str, Any]) -> Comparison:
    """Field-by-field comparison of two JSON objects."""
    flat_a, flat_b = flatten(a), flatten(b)
    fields = tuple(sorted(set(flat_a) | set(flat_b)))
    disagree = tuple(
        f
        for f in fields
        if f not in flat_a or f not in flat_b or not values_agree(flat_a[f], flat_b[f])
    )
    ratio = 1.0 if not fields else (len(fields) - len(disagree)) / len(fields)
    return Comparison("json", not disagree, ratio, fields, disagree)


def compare_text(a: str, b: str) -> Comparison:
    """Normalised exact match plus token-overlap F1."""
    return Comparison("text", normalise(a) == normalise(b), token_f1(a, b))


def parse_json_object(text: str) -> dict[str, Any] | None:
    """``text`` as a JSON object (after stripping whitespace and a code fence), else None."""
    stripped = _unfence(text.strip())
    if not stripped.startswith("{"):
        return None
    try:
        obj = json.loads(stripped)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def flatten(obj: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects as ``{"a.b": value}``; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{path}."))
        else:
            out[path] = value
    return out


def values_agree(a: Any, b: Any) -> bool:
    """Equality after normalisation (see the module doc)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return bool(a == b)
    if isinstance(a, str) and isinstance(b, str):
        return normalise(a) == normalise(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(values_agree(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return compare_json(a, b).agree
    return a is None and b is None


def _unfence(text: str) -> str:
    """The body of a Markdown code fence (```` ```json ... ``` ````), stripped; else ``text``.

    Plain string operations, linear in the text: the regex this replaces
    (``^```[A-Za-z]*\\s*\\n?(.*?)\\n?\\s*```$``, DOTALL) backtracked in cubic time on a
    fence followed by a whitespace run (2,000 spaces: 6 s, 4,000: 78 s, in the broker's
    loop, which writes the migration log) - a model output a client can ask for.
    """
    if len(text) < 2 * len(_FENCE) or not (text.startswith(_FENCE) and text.endswith(_FENCE)):
        return text
    body = text[len(_FENCE) : -len(_FENCE)]
    lang = 0  # the language tag: ASCII letters right after the opening fence
    while lang < len(body) and body[lang].isascii() and body[lang].isalpha():
        lang += 1
    return body[lang:].strip()


def token_f1(a: str, b: str) -> float:
    """Bag-of-words F1 of the two texts' word tokens (1.0 when both have none)."""
    ta, tb = Counter(_TOKEN.findall(normalise(a))), Counter(_TOKEN.findall(normalise(b)))
    if not ta and not tb:
        return 1.0
    shared = sum((ta & tb).values())
    if shared == 0:
        return 0.0
    precision = shared / sum(ta.values())
    recall = shared / sum(tb.values())
    return 2 * precision * recall / (precision + recall)
