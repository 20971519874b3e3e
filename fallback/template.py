"""Response templates of the rule file: ``{name}`` placeholders in text and JSON.

A placeholder is ``{name}`` or ``{name:converter}``; ``name`` is a regex group or a JSON field
path (``sensor.temp``); ``{{`` and ``}}`` are literal braces. Parsing happens once, at load
time, so a rule file with a broken template is refused before the node starts.

Rendering rules (documented for authors in ``etc/rules.toml``):

* A string that is exactly one placeholder becomes the typed value: a regex capture stays a
  string, a JSON field keeps its JSON type, a converter changes it (``number`` -> 21 or 21.5).
  If nothing was captured, the key (or list element) is left out: optional groups give
  optional fields, as in the intent schema.
* A placeholder inside longer text is replaced by the value's text, ``""`` if not captured.
* A value that cannot be converted (``{t:number}`` on ``"warm"``) raises ``Unconvertible``:
  the rule then does not match, so a wrong type never reaches a device.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: Converters a placeholder may name; "" means "as captured".
CONVERTERS = ("str", "lower", "int", "number")

_TOKEN = re.compile(r"\{\{|\}\}|\{([^{}]*)\}|[{}]")
#: A name: a regex group name, or a dotted path of JSON object keys.
NAME_RE = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*"
_PLACEHOLDER = re.compile(rf"({NAME_RE})(?::([a-z]+))?")
_INT = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:[.,]\d*)?|[.,]\d+)")


class Unconvertible(ValueError):
    """A captured value does not fit its placeholder's converter."""


@dataclass(frozen=True)
class Placeholder:
    """``{name:convert}``; ``convert`` is ``""`` when none was given."""

    name: str
    convert: str = ""


@dataclass(frozen=True)
class Template:
    """A parsed template string: literal pieces and placeholders, in order."""

    parts: tuple[str | Placeholder, ...]

    @property
    def names(self) -> set[str]:
        """Names of every placeholder in the template."""
        return {p.name for p in self.parts if isinstance(p, Placeholder)}

    @property
    def whole(self) -> Placeholder | None:
        """The placeholder when the template is exactly one, else None."""
        only = self.parts[0] if len(self.parts) == 1 else None
        return only if isinstance(only, Placeholder) else None


#: Marker for "leave this key or element out" while rendering JSON.
_OMIT = object()


def parse_template(text: str) -> Template:
    """Parse one template string.

    Raises:
        ValueError: a malformed placeholder, an unknown converter or a lone brace; the
            message says which and how to write a literal brace.
    """
    parts: list[str | Placeholder] = []
    pos = 0
    for m in _TOKEN.finditer(text):
        parts.append(text[pos : m.start()])
        pos = m.end()
        token = m.group(0)
        if token in ("{{", "}}"):
            parts.append(token[0])
        elif m.group(1) is None:
            raise ValueError(f"lone {token!r} at position {m.start()}; write {token * 2}")
        else:
            parts.append(_placeholder(m.group(1)))
    parts.append(text[pos:])
    return Template(tuple(_merge_literals(parts)))


def _placeholder(inner: str) -> Placeholder:
    m = _PLACEHOLDER.fullmatch(inner.strip())
    if m is None:
        raise ValueError(f"bad placeholder {{{inner}}}: expected {{name}} or {{name:converter}}")
    convert = m.group(2) or ""
    if convert and convert not in CONVERTERS:
        choices = ", ".join(CONVERTERS)
        raise ValueError(f"{{{inner}}}: unknown converter {convert!r}; one of {choices}")
    return Placeholder(m.group(1), convert)


def _merge_literals(parts: list[str | Placeholder]) -> list[str | Placeholder]:
    out: list[str | Placeholder] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        elif part != "":
            out.append(part)
    return out


def parse_json_template(value: Any, path: str) -> Any:
    """Parse every string of a JSON-shaped value (tables, arrays, scalars) as a template.

    Args:
        value: as read from TOML.
        path: where ``value`` sits, for error messages (e.g. ``json.room``).

    Raises:
        ValueError: a bad template, or a value JSON cannot hold (a TOML date or time).
    """
    if isinstance(value, str):
        try:
            return parse_template(value)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    if isinstance(value, dict):
        return {k: parse_json_template(v, f"{path}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [parse_json_template(v, f"{path}[{i}]") for i, v in enumerate(value)]
    if value is None or isinstance(value, (bool, int, float)):
        return value
    raise ValueError(f"{path}: {type(value).__name__} values cannot appear in JSON")


def json_template_names(tree: Any) -> set[str]:
    """Names of every placeholder in a parsed JSON template."""
    if isinstance(tree, Template):
        return tree.names
    if isinstance(tree, dict):
        return set().union(*(json_template_names(v) for v in tree.values()))
    if isinstance(tree, list):
        return set().union(*(json_template_names(v) for v in tree))
    return set()


def render_text(template: Template, values: dict[str, Any]) -> str:
    """Render a template as text (every placeholder becomes its text form).

    Raises:
        Unconvertible: a value does not fit its converter.
    """
    out = []
    for part in template.parts:
        if isinstance(part, str):
            out.append(part)
        else:
            value = values.get(part.name)
            out.append("" if value is None else _as_text(_convert(value, part)))
    return "".join(out)


def render_json(tree: Any, values: dict[str, Any]) -> Any:
    """Render a parsed JSON template; keys whose whole-placeholder captured nothing are dropped.

    Raises:
        Unconvertible: a value does not fit its converter.
    """
    rendered = _render(tree, values)
    return None if rendered is _OMIT else rendered


def _render(tree: Any, values: dict[str, Any]) -> Any:
    if isinstance(tree, Template):
        whole = tree.whole
        if whole is None:
            return render_text(tree, values)
        value = values.get(whole.name)
        return _OMIT if value is None else _convert(value, whole)
    if isinstance(tree, dict):
        items = ((k, _render(v, values)) for k, v in tree.items())
        return {k: v for k, v in items if v is not _OMIT}
    if isinstance(tree, list):
        return [v for v in (_render(x, values) for x in tree) if v is not _OMIT]
    return tree


def _convert(value: Any, ph: Placeholder) -> Any:
    if ph.convert == "":
        return value
    if ph.convert == "str":
        return _as_text(value)
    if ph.convert == "lower":
        return _as_text(value).lower()
    if isinstance(value, bool):
        raise Unconvertible(f"{ph.name}: a boolean is not a number")
    if ph.convert == "int":
        return _to_int(value, ph.name)
    return _to_number(value, ph.name)


def _to_int(value: Any, name: str) -> int:
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INT.fullmatch(value.strip()):
        return int(value)
    raise Unconvertible(f"{name}: {value!r} is not an integer")


def _to_number(value: Any, name: str) -> int | float:
    """Numbers stay as they are; text "21" -> 21, "21.5" or "21,5" -> 21.5."""
    if isinstance(value, (int, float)):
        return value
    text = value.strip() if isinstance(value, str) else ""
    if _INT.fullmatch(text):
        return int(text)
    if _NUMBER.fullmatch(text):
        return float(text.replace(",", "."))
    raise Unconvertible(f"{name}: {value!r} is not a number")


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
