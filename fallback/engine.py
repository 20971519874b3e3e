"""The rule engine: first matching rule answers, deterministically, in microseconds.

``RuleEngine.answer`` takes a worker REQUEST body (``docs/PROTOCOL.md`` §13.3) and returns
the same final fields a model engine returns, plus ``confidence`` and ``rule``, so the
broker can serve, compare and log both engines' answers alike. ``RuleEngine.run`` has the
signature of ``node.engine.Engine.run`` (structurally: this package never imports ``node``),
so the ordinary worker process can host it with ``kind = "rules"``.

Matching a rule (every key it has must pass; keys it lacks are not checked):

1. a rule with ``when`` needs the request text to be a JSON object (telemetry);
2. ``any``: at least one keyword; ``all``: every keyword; ``none``: no keyword;
3. ``regex`` must be found (RE2's ``search``, ``fallback.regex``) in the normalised text; its
   named groups are captures (a group that did not take part captures nothing); ``not_regex``
   must not be found;
4. each ``extract`` pattern adds its named groups if found, and is skipped if not;
5. every ``when`` condition holds; its field's value is captured under the field's path;
6. ``capture`` fields are captured if present;
7. the response renders; a capture that does not fit its converter makes the rule not match.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.errors import Cancelled, ProtocolError
from fallback.regex import prepare
from fallback.rule_keys import Condition
from fallback.rules import Rule, RuleSet, load_rules
from fallback.template import Unconvertible, render_json, render_text
from fallback.text import normalise_text

#: Requests longer than this (characters) match no rule: no command or telemetry message is
#: that long, and it bounds the regex work an oversized prompt can cause.
MAX_MATCH_CHARS = 8192
#: JSON separators of every JSON answer, the compact form a grammar-constrained model emits.
JSON_SEPARATORS = (",", ":")
#: Debug only, for fault tests of the node: a request whose text equals this environment
#: variable's value makes a rule engine built by ``from_file`` (the rule worker's) hang
#: without progress and deaf to cancellation, as Python's backtracking ``re`` did on a
#: catastrophic regex before RE2. Unset (the default), nothing changes.
HANG_ON_ENV = "EDGENODE_DEBUG_RULES_HANG_ON"

_MISSING = object()


@dataclass(frozen=True)
class Match:
    """The rule that matched, what it captured, and its rendered response(s)."""

    rule: Rule
    values: dict[str, Any]
    text: str | None
    json: dict[str, Any] | None


class RuleEngine:
    """Answers requests from an ordered ``RuleSet``; stateless apart from a step counter.

    The attributes ``kind``, ``model``, ``n_ctx`` and ``steps`` make it fit the worker's
    ``Engine`` protocol: READY then says ``engine: "rules"``.
    """

    kind = "rules"
    #: No context window: the rules read any text up to ``MAX_MATCH_CHARS``; reported in
    #: READY only, so a size check must skip rule workers rather than compare against it.
    n_ctx = 1 << 20

    def __init__(self, rules: RuleSet, *, hang_on: str | None = None) -> None:
        self.rules = rules
        self.model = f"rules:{Path(rules.source).name}"
        self.steps = 0
        self._hang_on = hang_on  # HANG_ON_ENV's fault injection; None in normal use

    @classmethod
    def from_file(cls, path: str | Path) -> RuleEngine:
        """Load and validate ``path`` (raises ``fallback.rules.RulesError``); the
        debug-only ``HANG_ON_ENV`` is read here."""
        return cls(load_rules(path), hang_on=os.environ.get(HANG_ON_ENV) or None)

    def warm_up(self) -> None:
        """Build every pattern's RE2 programs now (``fallback.regex.prepare``): a rule's
        first match otherwise costs 30-45 ms, which a caller with a latency budget (the
        defensive client's ``broker.client_guard.NodeGuard``) cannot spare. Costs
        ~7 ms a pattern here, once."""
        for rule in self.rules.rules:
            singles = (rule.any_of, rule.none_of, rule.regex, rule.not_regex)
            for regex in (*singles, *rule.all_of, *rule.extract):
                if regex is not None:
                    prepare(regex)

    # ------------------------------------------------------------------ matching

    def match(self, text: str) -> Match | None:
        """The first rule matching ``text`` (a command, or a JSON object as text), or None."""
        if len(text) > MAX_MATCH_CHARS:
            return None
        norm = normalise_text(text)
        doc = _json_object(text)
        for rule in self.rules.rules:
            found = _match_rule(rule, norm, doc)
            if found is not None:
                return found
        return None

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer a worker REQUEST body (``op`` generate with ``prompt``, or chat with
        ``messages``: the last user message is the command).

        Returns:
            ``{"text", "finish_reason": "stop", "usage": {"prompt_tokens": 0,
            "completion_tokens": 0}, "confidence", "rule"}``; ``rule`` is None and
            ``confidence`` 0.0 when no rule matched. With ``json_schema`` in the request the
            text is the rule's JSON (compact separators), else the rule's text if it has one.

        Raises:
            ProtocolError: an op other than generate/chat, or a missing prompt/messages.
        """
        self.steps += 1
        text = request_text(request)
        if text == self._hang_on:
            threading.Event().wait()  # the injected fault: never returns
        found = self.match(text)
        wants_json = request.get("json_schema") is not None
        if found is None:
            no_match = self.rules.no_match
            text = _pick(no_match.text, no_match.json, wants_json)
            return _result(text, 0.0, None)
        return _result(
            _pick(found.text, found.json, wants_json), found.rule.confidence, found.rule.name
        )

    def run(
        self, job: dict[str, Any], cancelled: threading.Event, emit: Callable[[str], None]
    ) -> dict[str, Any]:
        """``node.engine.Engine.run``: the whole answer is one chunk.

        Raises:
            Cancelled: ``cancelled`` was already set.
            ProtocolError: see ``answer``.
        """
        if cancelled.is_set():
            raise Cancelled("cancelled")
        result = self.answer(job)
        if result["text"]:
            emit(result["text"])
        return result


def request_text(request: dict[str, Any]) -> str:
    """The text the rules read: ``prompt`` of generate, the last user message of chat.

    Raises:
        ProtocolError: another op, or the field is missing or mistyped.
    """
    op = request.get("op")
    if op == "generate":
        prompt = request.get("prompt")
        if not isinstance(prompt, str):
            raise ProtocolError("generate needs a string 'prompt'")
        return prompt
    if op == "chat":
        messages = request.get("messages")
        if not isinstance(messages, list):
            raise ProtocolError("chat needs a list of 'messages'")
        users = [
            m.get("content") for m in messages if isinstance(m, dict) and m.get("role") == "user"
        ]
        last = users[-1] if users else ""
        return last if isinstance(last, str) else ""
    raise ProtocolError(f"the rule engine serves generate and chat, not {op!r}")


def _pick(text: str | None, obj: dict[str, Any] | None, wants_json: bool) -> str:
    if obj is not None and (wants_json or text is None):
        return json.dumps(obj, separators=JSON_SEPARATORS, ensure_ascii=False)
    return text or ""


def _result(text: str, confidence: float, rule: str | None) -> dict[str, Any]:
    return {
        "text": text,
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 0, "completion_tokens": 0},
        "confidence": confidence,
        "rule": rule,
    }


def _json_object(text: str) -> dict[str, Any] | None:
    """``text`` parsed as a JSON object, or None (a command in words, a list, bad JSON)."""
    stripped = text.strip()
    if not stripped.startswith("{"):
        return None  # cheap: most requests are words
    try:
        obj = json.loads(stripped)
    except (ValueError, RecursionError):  # deep nesting is no telemetry either
        return None
    return obj if isinstance(obj, dict) else None


def _match_rule(rule: Rule, norm: str, doc: dict[str, Any] | None) -> Match | None:
    if rule.when and doc is None:
        return None
    if rule.any_of is not None and not rule.any_of.search(norm):
        return None
    if not all(p.search(norm) for p in rule.all_of):
        return None
    if rule.none_of is not None and rule.none_of.search(norm):
        return None
    values: dict[str, Any] = {}
    if rule.regex is not None:
        m = rule.regex.search(norm)
        if m is None:
            return None
        values.update(m.groupdict())
    if rule.not_regex is not None and rule.not_regex.search(norm):
        return None
    for pattern in rule.extract:
        m = pattern.search(norm)
        if m is not None:
            for name, value in m.groupdict().items():
                if values.get(name) is None:
                    values[name] = value
    if doc is not None and not _fields_hold(rule, doc, values):
        return None
    try:
        text = None if rule.text is None else render_text(rule.text, values)
        obj = None if rule.json is None else render_json(rule.json, values)
    except Unconvertible:
        return None
    return Match(rule, values, text, obj)


def _fields_hold(rule: Rule, doc: dict[str, Any], values: dict[str, Any]) -> bool:
    """Check ``when`` and capture ``when``/``capture`` fields into ``values``."""
    for cond in rule.when:
        value = field_value(doc, cond.field)
        if not condition_holds(cond, value):
            return False
        values[cond.field] = None if value is _MISSING else value
    for path in rule.capture:
        value = field_value(doc, path)
        values[path] = None if value is _MISSING else value
    return True


def field_value(doc: dict[str, Any], path: str) -> Any:
    """The value at a dotted ``path`` of ``doc``, or the ``_MISSING`` marker."""
    value: Any = doc
    for key in path.split("."):
        if not isinstance(value, dict) or key not in value:
            return _MISSING
        value = value[key]
    return value


def condition_holds(cond: Condition, value: Any) -> bool:
    """Whether ``value`` (maybe ``_MISSING``) satisfies ``cond``.

    A missing or null field fails every condition except ``exists = false``. Numeric
    operators need a number (not a boolean); ``==``/``!=``/``in`` compare numbers by value and
    strings case-insensitively, and never equate a boolean with a number.
    """
    present = value is not _MISSING and value is not None
    if cond.op == "exists":
        return present is cond.value
    if not present:
        return False
    if cond.op == "==":
        return _same(value, cond.value)
    if cond.op == "!=":
        return not _same(value, cond.value)
    if cond.op == "in":
        return any(_same(value, v) for v in cond.value)
    if not _is_number(value):
        return False
    return _compare(cond.op, float(value), float(cond.value))


def _compare(op: str, a: float, b: float) -> bool:
    if op == ">":
        return a > b
    if op == ">=":
        return a >= b
    if op == "<":
        return a < b
    return a <= b


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if _is_number(a) and _is_number(b):
        return bool(a == b)
    if isinstance(a, str) and isinstance(b, str):
        return a.casefold() == b.casefold()
    return False
