"""Rule files: load ordered rules from TOML and validate them once, at load time.

The file format is documented key by key at the top of ``etc/rules.toml``. Every problem is
reported, not only the first, and each message names the rule (number in file order, from 1,
and name) and the key, e.g. ``rule #3 "lights_on": regex: missing ), unterminated subpattern
at position 4``. Matching lives in ``fallback.engine``; this module only builds the rules.

Keyword semantics (``any``/``all``/``none``) are those of ``fallback.text``.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from re import Pattern
from typing import Any

from broker.protocol import ConfigError
from fallback.template import (
    NAME_RE,
    Template,
    json_template_names,
    parse_json_template,
    parse_template,
)
from fallback.text import keyword_pattern, normalise_text

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

#: Condition operators on JSON fields of structured requests.
OPS = (">", ">=", "<", "<=", "==", "!=", "in", "exists")
NUMERIC_OPS = (">", ">=", "<", "<=")
RULE_KEYS = (
    "name", "description", "any", "all", "none", "regex", "extract", "when", "capture",
    "text", "json", "confidence",
)  # fmt: skip
CONDITION_KEYS = ("field", "op", "value")
NO_MATCH_TEXT = "no rule matched"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
_FIELD = re.compile(NAME_RE)


class RulesError(ConfigError):
    """A rule file is unreadable or invalid; ``errors`` lists every problem found."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.errors = tuple(errors)
        lines = "\n".join(f"  {e}" for e in errors)
        super().__init__(f"{source}: {len(errors)} error(s)\n{lines}")


@dataclass(frozen=True)
class Condition:
    """``field op value`` on a JSON object request; ``field`` is a dotted path."""

    field: str
    op: str
    value: Any


@dataclass(frozen=True)
class Rule:
    """One validated rule. ``index`` counts from 1 in file order; patterns are compiled."""

    index: int
    name: str
    confidence: float
    description: str = ""
    any_of: Pattern[str] | None = None
    all_of: tuple[Pattern[str], ...] = ()
    none_of: Pattern[str] | None = None
    regex: Pattern[str] | None = None
    extract: tuple[Pattern[str], ...] = ()
    when: tuple[Condition, ...] = ()
    capture: tuple[str, ...] = ()
    text: Template | None = None
    json: Any = None  # a parsed JSON template (dict), see fallback.template


@dataclass(frozen=True)
class NoMatch:
    """The answer when no rule matches: literal text, and optionally literal JSON."""

    text: str = NO_MATCH_TEXT
    json: dict[str, Any] | None = None


@dataclass(frozen=True)
class RuleSet:
    """The rules of one file, in order (first match wins)."""

    rules: tuple[Rule, ...]
    no_match: NoMatch = NoMatch()
    source: str = "<dict>"


# --------------------------------------------------------------------------- loading


def load_rules(path: str | Path) -> RuleSet:
    """Read and validate a rule file.

    Raises:
        RulesError: unreadable file, invalid TOML, or invalid rules (all of them listed).
    """
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise RulesError(source, [f"cannot read the file: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise RulesError(source, [f"not UTF-8: {exc}"]) from exc
    return loads_rules(text, source)


def loads_rules(text: str, source: str = "<string>") -> RuleSet:
    """Parse and validate rules from TOML text.

    Raises:
        RulesError: invalid TOML or invalid rules.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise RulesError(source, [f"not valid TOML: {exc}"]) from exc
    return parse_rules(data, source)


def parse_rules(data: Mapping[str, Any], source: str = "<dict>") -> RuleSet:
    """Validate parsed TOML (or a dict of the same shape) into a ``RuleSet``.

    Raises:
        RulesError: every problem found, each naming the rule and the key.
    """
    errors: list[str] = [
        f"unknown top-level key {k!r}" for k in data if k not in ("rule", "no_match")
    ]
    raw_rules = data.get("rule", [])
    if not isinstance(raw_rules, list) or not all(isinstance(r, dict) for r in raw_rules):
        errors.append("'rule' must be an array of tables: write each rule under [[rule]]")
        raw_rules = []
    elif not raw_rules:
        errors.append("no rules: the file defines no [[rule]] table")
    rules = []
    seen: dict[str, int] = {}
    for index, raw in enumerate(raw_rules, start=1):
        rule, rule_errors = _parse_rule(index, raw)
        errors.extend(rule_errors)
        name = raw.get("name")
        if isinstance(name, str):  # checked even when the rule has other errors
            if name in seen:
                errors.append(f'rule #{index} "{name}": name: duplicate of rule #{seen[name]}')
            seen.setdefault(name, index)
        if rule is not None:
            rules.append(rule)
    no_match = _parse_no_match(data.get("no_match", {}), errors)
    if errors:
        raise RulesError(source, errors)
    return RuleSet(tuple(rules), no_match, source)


def _parse_no_match(raw: Any, errors: list[str]) -> NoMatch:
    if not isinstance(raw, dict):
        errors.append("no_match: must be a table with 'text' and/or 'json'")
        return NoMatch()
    errors.extend(f"no_match: unknown key {k!r}" for k in raw if k not in ("text", "json"))
    text = raw.get("text", NO_MATCH_TEXT)
    obj = raw.get("json")
    if not isinstance(text, str):
        errors.append("no_match: text: must be a string")
        text = NO_MATCH_TEXT
    if obj is not None and not isinstance(obj, dict):
        errors.append("no_match: json: must be a table (a JSON object)")
        obj = None
    return NoMatch(text, obj)


class _FieldError(Exception):
    """One bad key of one rule: ``key`` and what is wrong with it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(message)
        self.key = key
        self.message = message


def _parse_rule(index: int, raw: dict[str, Any]) -> tuple[Rule | None, list[str]]:
    name = raw.get("name")
    label = f'rule #{index} "{name}"' if isinstance(name, str) else f"rule #{index}"
    errors: list[str] = [f"{label}: unknown key {k!r}" for k in raw if k not in RULE_KEYS]
    fields: dict[str, Any] = {}

    def take(key: str, check: Callable[[str, Any], Any], *, required: bool = False) -> None:
        if key not in raw:
            if required:
                errors.append(f"{label}: {key}: missing (required)")
            return
        try:
            fields[key] = check(key, raw[key])
        except _FieldError as exc:
            errors.append(f"{label}: {exc.key}: {exc.message}")

    take("name", _check_name, required=True)
    take("confidence", _check_confidence, required=True)
    take("description", _check_str)
    for key in ("any", "none"):
        take(key, lambda k, v: keyword_pattern(_check_words(k, v)))
    take("all", lambda k, v: tuple(keyword_pattern([w]) for w in _check_words(k, v)))
    take("regex", _check_regex)
    take("extract", _check_extract)
    take("when", _check_when)
    take("capture", _check_capture)
    take("text", _check_text)
    take("json", _check_json)
    if errors:
        return None, errors
    errors.extend(f"{label}: {e}" for e in _check_rule_shape(fields))
    if errors:
        return None, errors
    return _build_rule(index, fields), []


def _build_rule(index: int, f: dict[str, Any]) -> Rule:
    return Rule(
        index=index,
        name=f["name"],
        confidence=f["confidence"],
        description=f.get("description", ""),
        any_of=f.get("any"),
        all_of=f.get("all", ()),
        none_of=f.get("none"),
        regex=f.get("regex"),
        extract=f.get("extract", ()),
        when=f.get("when", ()),
        capture=f.get("capture", ()),
        text=f.get("text"),
        json=f.get("json"),
    )


def _check_rule_shape(f: dict[str, Any]) -> list[str]:
    """Cross-key checks: a positive matcher, a response, placeholders that something captures."""
    errors = []
    if not any(k in f for k in ("any", "all", "regex", "when")):
        errors.append("needs at least one matcher: any, all, regex or when")
    if "text" not in f and "json" not in f:
        errors.append("needs a response: text and/or json")
    captured = _captured_names(f)
    for key in ("text", "json"):
        if key not in f:
            continue
        names = f[key].names if key == "text" else json_template_names(f[key])
        for missing in sorted(names - captured):
            errors.append(
                f"{key}: placeholder {{{missing}}} is not captured by any matcher "
                "(a regex/extract named group, a 'when' field or a 'capture' field)"
            )
    return errors


def _captured_names(f: dict[str, Any]) -> set[str]:
    names: set[str] = set()
    for pattern in [f.get("regex"), *f.get("extract", ())]:
        if pattern is not None:
            names.update(pattern.groupindex)
    names.update(c.field for c in f.get("when", ()))
    names.update(f.get("capture", ()))
    return names


# --------------------------------------------------------------------------- key checks


def _check_name(key: str, value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise _FieldError(
            key, "must be 1-64 letters, digits or _ . : - and start with a letter or digit"
        )
    return value


def _check_confidence(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _FieldError(key, f"must be a number in [0, 1], got {type(value).__name__}")
    if not 0 <= value <= 1:
        raise _FieldError(key, f"must be in [0, 1], got {value}")
    return float(value)


def _check_str(key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise _FieldError(key, f"must be a string, got {type(value).__name__}")
    return value


def _check_words(key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _FieldError(key, "must be a non-empty array of strings")
    for i, word in enumerate(value):
        if not isinstance(word, str) or not normalise_text(word):
            raise _FieldError(f"{key}[{i}]", "must be a non-empty string")
    return value


def _compile(key: str, value: Any) -> Pattern[str]:
    if not isinstance(value, str) or not value:
        raise _FieldError(key, "must be a non-empty string (a Python regular expression)")
    try:
        return re.compile(value, re.IGNORECASE)
    except re.error as exc:
        raise _FieldError(key, str(exc)) from None


def _check_regex(key: str, value: Any) -> Pattern[str]:
    return _compile(key, value)


def _check_extract(key: str, value: Any) -> tuple[Pattern[str], ...]:
    if not isinstance(value, list) or not value:
        raise _FieldError(key, "must be a non-empty array of regular expressions")
    patterns = []
    for i, item in enumerate(value):
        pattern = _compile(f"{key}[{i}]", item)
        if not pattern.groupindex:
            raise _FieldError(f"{key}[{i}]", "has no named group (?P<name>...) to capture")
        patterns.append(pattern)
    return tuple(patterns)


def _check_field(key: str, value: Any) -> str:
    if not isinstance(value, str) or not _FIELD.fullmatch(value):
        raise _FieldError(key, f"must be a JSON field name or dotted path, got {value!r}")
    return value


def _check_capture(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise _FieldError(key, "must be a non-empty array of JSON field names")
    return tuple(_check_field(f"{key}[{i}]", v) for i, v in enumerate(value))


def _check_when(key: str, value: Any) -> tuple[Condition, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(c, dict) for c in value):
        raise _FieldError(key, "must be a non-empty array of {field, op, value} tables")
    return tuple(_check_condition(f"{key}[{i}]", c) for i, c in enumerate(value))


def _check_condition(key: str, raw: dict[str, Any]) -> Condition:
    unknown = [k for k in raw if k not in CONDITION_KEYS]
    if unknown:
        raise _FieldError(key, f"unknown key {unknown[0]!r}")
    field = _check_field(f"{key}.field", raw.get("field"))
    op = raw.get("op")
    if op not in OPS:
        raise _FieldError(f"{key}.op", f"must be one of {' '.join(OPS)}; got {op!r}")
    if op == "exists":
        value = raw.get("value", True)
        if not isinstance(value, bool):
            raise _FieldError(f"{key}.value", "must be true or false for 'exists'")
        return Condition(field, op, value)
    if "value" not in raw:
        raise _FieldError(f"{key}.value", "missing (required)")
    return Condition(field, op, _check_operand(f"{key}.value", op, raw["value"]))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_operand(key: str, op: str, value: Any) -> Any:
    if op in NUMERIC_OPS and not _is_number(value):
        raise _FieldError(key, f"must be a number for {op!r}, got {type(value).__name__}")
    if op == "in":
        ok = isinstance(value, list) and value and all(_is_scalar(v) for v in value)
        if not ok:
            raise _FieldError(key, "must be a non-empty array of strings, numbers or booleans")
        return tuple(value)
    if op in ("==", "!=") and not _is_scalar(value):
        raise _FieldError(key, f"must be a string, number or boolean, got {type(value).__name__}")
    return value


def _is_scalar(value: Any) -> bool:
    return isinstance(value, (str, bool, int, float))


def _check_text(key: str, value: Any) -> Template:
    if not isinstance(value, str):
        raise _FieldError(key, f"must be a string, got {type(value).__name__}")
    try:
        return parse_template(value)
    except ValueError as exc:
        raise _FieldError(key, str(exc)) from None


def _check_json(key: str, value: Any) -> Any:
    if not isinstance(value, dict):
        raise _FieldError(key, "must be a table (a JSON object template)")
    try:
        return parse_json_template(value, key)
    except ValueError as exc:
        # The message already starts with the path inside the template (json.room: ...).
        path, _, message = str(exc).partition(": ")
        raise _FieldError(path, message) from None
