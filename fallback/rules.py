"""Rule files: load ordered rules from TOML and validate them once, at load time.

The file format is documented key by key at the top of ``etc/rules.toml``. Every problem is
reported, not only the first, and each message names the rule (number in file order, from 1,
and name) and the key, e.g. ``rule #3 "lights_on": regex: missing ), unterminated subpattern
at position 4``. Matching lives in ``fallback.engine``; this module only builds the rules.

Keyword semantics (``any``/``all``/``none``) are those of ``fallback.text``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from broker.errors import ConfigError
from fallback.regex import Regex
from fallback.rule_keys import (
    Condition,
    FieldError,
    check_capture,
    check_confidence,
    check_extract,
    check_json,
    check_name,
    check_regex,
    check_str,
    check_text,
    check_when,
    check_words,
)
from fallback.template import (
    Template,
    json_template_names,
)
from fallback.text import keyword_pattern

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib  # type: ignore[import-not-found,unused-ignore]

RULE_KEYS = (
    "name", "description", "any", "all", "none", "regex", "not_regex", "extract", "when",
    "capture", "text", "json", "confidence",
)  # fmt: skip
NO_MATCH_TEXT = "no rule matched"


class RulesError(ConfigError):
    """A rule file is unreadable or invalid; ``errors`` lists every problem found."""

    def __init__(self, source: str, errors: list[str]) -> None:
        self.errors = tuple(errors)
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        #: One line: the source and its first error (a worker's status shows it).
        self.summary = f"{source}: {errors[0] if errors else 'invalid'}{more}"
        lines = "\n".join(f"  {e}" for e in errors)
        super().__init__(f"{source}: {len(errors)} error(s)\n{lines}")


@dataclass(frozen=True)
class Rule:
    """One validated rule. ``index`` counts from 1 in file order; patterns are compiled
    with RE2 (``fallback.regex``), keywords included."""

    index: int
    name: str
    confidence: float
    description: str = ""
    any_of: Regex | None = None
    all_of: tuple[Regex, ...] = ()
    none_of: Regex | None = None
    regex: Regex | None = None
    not_regex: Regex | None = None
    extract: tuple[Regex, ...] = ()
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
        except FieldError as exc:
            errors.append(f"{label}: {exc.key}: {exc.message}")

    take("name", check_name, required=True)
    take("confidence", check_confidence, required=True)
    take("description", check_str)
    for key in ("any", "none"):
        take(key, lambda k, v: keyword_pattern(check_words(k, v)))
    take("all", lambda k, v: tuple(keyword_pattern([w]) for w in check_words(k, v)))
    take("regex", check_regex)
    take("not_regex", check_regex)
    take("extract", check_extract)
    take("when", check_when)
    take("capture", check_capture)
    take("text", check_text)
    take("json", check_json)
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
        not_regex=f.get("not_regex"),
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
