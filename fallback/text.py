"""Text normalisation and keyword patterns shared by the rules and the output comparison.

Keyword semantics (the ``any``/``all``/``none`` keys of a rule): a keyword is a word or phrase
matched case-insensitively on the normalised text at word boundaries. A keyword that starts
(ends) with a letter, digit or ``_`` must not be preceded (followed) by one, and a space inside
a phrase matches any whitespace. So ``stop`` matches "stop!" and "robot, stop" but not
"stopwatch" or "stops"; and it does match "don't stop believing": boundaries are about words,
not meaning. Rules that act on devices therefore anchor their ``regex`` to the command's shape
and list negations under ``none``, as the default rule set does. Keywords that start or end
with a symbol (``°c``) get no boundary on that side, so "23°c" still contains ``°c``.
"Letter or digit" is Unicode's (categories L and N), as Python's ``str.isalnum``.
"""

from __future__ import annotations

import unicodedata

from fallback.regex import Regex, compile_regex, escape

_QUOTES = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"'})


def normalise_text(text: str) -> str:
    """NFKC (so "℃" is "°C"), typographic quotes made ASCII, lowercase, whitespace runs
    collapsed to one space, ends stripped."""
    text = unicodedata.normalize("NFKC", text).translate(_QUOTES).lower()
    return " ".join(text.split())


#: Anything but a letter, digit or ``_``. RE2 has no lookaround, so a boundary is this
#: character or an end of the text, consumed: the same for "is a keyword present".
_NOT_WORD = r"[^\pL\pN_]"


def keyword_pattern(keywords: list[str]) -> Regex:
    """One RE2 pattern that finds any of ``keywords`` in normalised text, at word boundaries.

    Only ``search(...) is not None`` is meaningful: a match includes the boundary characters.
    """
    alternatives = []
    for word in sorted({normalise_text(k) for k in keywords}, key=len, reverse=True):
        body = r"\s+".join(escape(w) for w in word.split(" "))
        head = f"(?:^|{_NOT_WORD})" if _is_word_char(word[0]) else ""
        tail = f"(?:{_NOT_WORD}|$)" if _is_word_char(word[-1]) else ""
        alternatives.append(head + body + tail)
    return compile_regex("|".join(alternatives), ignore_case=False)  # both sides are lowercase


def _is_word_char(char: str) -> bool:
    return char.isalnum() or char == "_"
