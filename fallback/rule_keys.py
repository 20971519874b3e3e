"""The keys of one rule in a rule file: each checked and converted alone.

``fallback.rules`` builds rules from these. Every ``check_*(key, value)`` returns
the converted value or raises ``FieldError`` naming the key and what is wrong with
it, so every problem of a file is reported. The format: the top of ``etc/rules.toml``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from fallback.regex import Regex, RegexError, compile_regex
from fallback.template import NAME_RE, Template, parse_json_template, parse_template
from fallback.text import normalise_text

#: Condition operators on JSON fields of structured requests.
OPS = (">", ">=", "<", "<=", "==", "!=", "in", "exists")
NUMERIC_OPS = (">", ">=", "<", "<=")
CONDITION_KEYS = ("field", "op", "value")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_FIELD = re.compile(NAME_RE)


@dataclass(frozen=True)
class Condition:
    """``field op value`` on a JSON object request; ``field`` is a dotted path."""

    field: str
    op: str
    value: Any


class FieldError(Exception):
    """One bad key of one rule: ``key`` and what is wrong with it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def check_name(key: str, value: Any) -> str:
    """A rule name: 1-64 of letters, digits, ``_.:-``, starting alphanumeric."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise FieldError(
            key, "must be 1-64 letters, digits or _ . : - and start with a letter or digit"
        )
    return value


def check_confidence(key: str, value: Any) -> float:
    """A confidence: a number in [0, 1] (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise FieldError(key, f"must be a number in [0, 1], got {type(value).__name__}")
    if not 0 <= value <= 1:
        raise FieldError(key, f"must be in [0, 1], got {value}")
    return float(value)


def check_str(key: str, value: Any) -> str:
    """Any string (``description``)."""
    if not isinstance(value, str):
        raise FieldError(key, f"must be a string, got {type(value).__name__}")
    return value


def check_words(key: str, value: Any) -> list[str]:
    """A non-empty list of keywords, none empty once normalised (``any``/``all``/``none``)."""
    if not isinstance(value, list) or not value:
        raise FieldError(key, "must be a non-empty array of strings")
    for i, word in enumerate(value):
        if not isinstance(word, str) or not normalise_text(word):
            raise FieldError(f"{key}[{i}]", "must be a non-empty string")
    return value


def _compile(key: str, value: Any) -> Regex:
    if not isinstance(value, str) or not value:
        raise FieldError(key, "must be a non-empty string (an RE2 regular expression)")
    try:
        return compile_regex(value)
    except RegexError as exc:
        raise FieldError(key, f"RE2 cannot compile it: {exc.reason}{_hint(exc.reason)}") from None


def _hint(reason: str) -> str:
    """What to write instead of the constructs RE2 refuses (they need backtracking)."""
    if "(?=" in reason or "(?!" in reason or "(?<=" in reason or "(?<!" in reason:
        return " (lookaround is not supported: use the rule's not_regex or none key, or match it)"
    if "escape sequence: \\" in reason and reason[-1:].isdigit():
        return " (backreferences are not supported)"
    if reason.endswith("escape sequence: \\Z"):
        return " (RE2 spells the end of the text \\z)"
    return ""


def check_regex(key: str, value: Any) -> Regex:
    """An RE2 regular expression, compiled case-insensitive (``regex``, ``not_regex``)."""
    return _compile(key, value)


def check_extract(key: str, value: Any) -> tuple[Regex, ...]:
    """Regular expressions that each capture a named group (``extract``)."""
    if not isinstance(value, list) or not value:
        raise FieldError(key, "must be a non-empty array of regular expressions")
    patterns = []
    for i, item in enumerate(value):
        pattern = _compile(f"{key}[{i}]", item)
        if not pattern.groupindex:
            raise FieldError(f"{key}[{i}]", "has no named group (?P<name>...) to capture")
        patterns.append(pattern)
    return tuple(patterns)


def check_field(key: str, value: Any) -> str:
    """A JSON field name or dotted path (``a.b.c``)."""
    if not isinstance(value, str) or not _FIELD.fullmatch(value):
        raise FieldError(key, f"must be a JSON field name or dotted path, got {value!r}")
    return value


def check_capture(key: str, value: Any) -> tuple[str, ...]:
    """JSON field names whose values a response may use (``capture``)."""
    if not isinstance(value, list) or not value:
        raise FieldError(key, "must be a non-empty array of JSON field names")
    return tuple(check_field(f"{key}[{i}]", v) for i, v in enumerate(value))


def check_when(key: str, value: Any) -> tuple[Condition, ...]:
    """``when``: a non-empty list of ``{field, op, value}`` conditions."""
    if not isinstance(value, list) or not value or not all(isinstance(c, dict) for c in value):
        raise FieldError(key, "must be a non-empty array of {field, op, value} tables")
    return tuple(check_condition(f"{key}[{i}]", c) for i, c in enumerate(value))


def check_condition(key: str, raw: dict[str, Any]) -> Condition:
    """One ``{field, op, value}`` table (``op`` in ``OPS``; ``exists`` takes a bool)."""
    unknown = [k for k in raw if k not in CONDITION_KEYS]
    if unknown:
        raise FieldError(key, f"unknown key {unknown[0]!r}")
    field = check_field(f"{key}.field", raw.get("field"))
    op = raw.get("op")
    if op not in OPS:
        raise FieldError(f"{key}.op", f"must be one of {' '.join(OPS)}; got {op!r}")
    if op == "exists":
        value = raw.get("value", True)
        if not isinstance(value, bool):
            raise FieldError(f"{key}.value", "must be true or false for 'exists'")
        return Condition(field, op, value)
    if "value" not in raw:
        raise FieldError(f"{key}.value", "missing (required)")
    return Condition(field, op, check_operand(f"{key}.value", op, raw["value"]))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_operand(key: str, op: str, value: Any) -> Any:
    """The ``value`` of a condition, of the type its ``op`` compares."""
    if op in NUMERIC_OPS and not _is_number(value):
        raise FieldError(key, f"must be a number for {op!r}, got {type(value).__name__}")
    if op == "in":
        ok = isinstance(value, list) and value and all(_is_scalar(v) for v in value)
        if not ok:
            raise FieldError(key, "must be a non-empty array of strings, numbers or booleans")
        return tuple(value)
    if op in ("==", "!=") and not _is_scalar(value):
        raise FieldError(key, f"must be a string, number or boolean, got {type(value).__name__}")
    return value


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, bool, int, float))


def check_text(key: str, value: Any) -> Template:
    """A text response template; its ``{placeholders}`` are parsed here."""
    if not isinstance(value, str):
        raise FieldError(key, f"must be a string, got {type(value).__name__}")
    try:
        return parse_template(value)
    except ValueError as exc:
        raise FieldError(key, str(exc)) from None


def check_json(key: str, value: Any) -> Any:
    """A JSON response template (a table); its placeholders are parsed here."""
    if not isinstance(value, dict):
        raise FieldError(key, "must be a table (a JSON object template)")
    try:
        return parse_json_template(value, key)
    except ValueError as exc:
        # The message already starts with the path inside the template (json.room: ...).
        path, _, message = str(exc).partition(": ")
        raise FieldError(path, message) from None
