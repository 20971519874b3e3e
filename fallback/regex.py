"""Regular expressions of the rules, in linear time: RE2 (``google-re2``), never Python's ``re``.

Python's ``re`` backtracks: a pattern like ``(a+)+$`` takes time exponential in the text
("aaaa...!"), holding the GIL, so one short prompt froze the rule worker (no heartbeats: lost)
and then its restarted successor. RE2 runs an automaton instead, in time linear in the text
(Cox, "Regular Expression Matching Can Be Simple And Fast", 2007; the RE2 wiki), and refuses
what needs backtracking: backreferences (``\\1``) and lookaround (``(?=``, ``(?!``, ``(?<=``,
``(?<!``). Its syntax: https://github.com/google/re2/wiki/Syntax. Unlike Python's ``re``,
``\\w``, ``\\d``, ``\\s`` and ``\\b`` are ASCII-only (``\\pL`` is any letter, ``\\pN`` any
digit); ``\\Z`` is spelt ``\\z``; case-insensitive matching still folds Unicode.

This is the only module that imports ``re2``. Without it, importing this module fails with
an ``ImportError`` saying what to install: there is deliberately no fallback to ``re``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, cast

try:
    import re2
except ImportError as exc:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError(
        "the rule engine needs RE2 for linear-time regular expressions: "
        "pip install google-re2 (it has no fallback to Python's backtracking re)"
    ) from exc

#: Per-pattern memory cap of RE2 (bytes; RE2's own default, 8 MiB): a pattern whose
#: automaton would need more fails to compile ("pattern too large") instead of growing.
MAX_MEM_BYTES = 8 << 20


class RegexMatch(Protocol):
    """What the rules read from a match: the named groups."""

    def groupdict(self) -> dict[str, str | None]:
        """Named group -> captured text, None for a group that did not take part."""
        ...


class Regex(Protocol):
    """A compiled RE2 pattern (the subset of its API the rules use)."""

    @property
    def pattern(self) -> str:
        """The source text of the pattern."""
        ...

    @property
    def groupindex(self) -> Mapping[str, int]:
        """Named group -> group number."""
        ...

    def search(self, text: str) -> RegexMatch | None:
        """The leftmost match anywhere in ``text``, or None; linear in ``len(text)``."""
        ...


class RegexError(ValueError):
    """A pattern RE2 cannot compile; ``reason`` is RE2's own words, e.g.
    ``invalid perl operator: (?<=`` (lookbehind) or ``invalid escape sequence: \\1``."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def compile_regex(pattern: str, *, ignore_case: bool = True) -> Regex:
    """Compile ``pattern`` with RE2 (case-insensitive unless ``ignore_case`` is False).

    Raises:
        RegexError: RE2 cannot compile it (bad syntax, backreference, lookaround,
            a repetition over 1000, an automaton over ``MAX_MEM_BYTES``).
    """
    options = re2.Options()
    options.case_sensitive = not ignore_case
    options.max_mem = MAX_MEM_BYTES
    options.log_errors = False  # the error goes to the caller, not to stderr
    try:
        return cast(Regex, re2.compile(pattern, options))
    except re2.error as exc:
        raise RegexError(_reason(exc)) from None


def prepare(regex: Regex) -> None:
    """Build ``regex``'s automata now rather than at its first match.

    RE2 compiles the reversed program, which a search uses to find where a match
    starts, lazily at the first match: 30-45 ms for a rule's patterns on a 2-core box,
    paid by the first request a rule answers. Reading its sizes builds both programs.
    """
    compiled: Any = regex
    _ = compiled.programsize, compiled.reverseprogramsize


def escape(text: str) -> str:
    """``text`` as a pattern that matches it literally."""
    return cast(str, re2.escape(text))


def _reason(exc: Any) -> str:
    # The binding raises its error with RE2's message as bytes.
    reason = exc.args[0] if exc.args else str(exc)
    return reason.decode("utf-8", "replace") if isinstance(reason, bytes) else str(reason)
