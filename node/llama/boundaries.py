"""Where a text can be cut so that llama.cpp tokenizes its pieces as it would the
whole: the piece machinery of ``node.llama.vocab.Vocab``.

Why: llama.cpp's tokenizer costs time growing with the square of the special-token
matches in a text. Its special-token partition (``tokenizer_st_partition`` in
``src/llama-vocab.cpp``) erases each match from a linked list of fragments by
walking the list from the start, so text dense in user-defined tokens (Gemma 3 has
one per newline, tab and HTML tag) is quadratic (measured: docs/bench/figures.md
§node.llama.boundaries). Cut into pieces of ~``PIECE_BYTES`` where no token can span,
a text costs time linear in its length, and a lower bound on its tokens comes from
its bytes alone.

What: the vocabulary's byte-pair table (``hold_pairs``, ``spell_spaces``: per byte
pair, the longest token text holding it; a pair none holds is a forced token
boundary), the stretches between forced boundaries with each one's lower bound
(``stretches``), their grouping into pieces (``piece_spans``), and the special
tokens' texts a piece can also be cut around (``Specials``), and counting a piece
as parse_special would with no control-token text parsed (``count_unparsed``).
Plain bytes and numpy arrays: reading the vocabulary and tokenizing are ``node.llama.vocab``'s, and
whether a vocabulary qualifies is checked there on ``SAMPLE``.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Collection, Iterator
from itertools import pairwise
from typing import Any

import numpy as np

#: Text is tokenized in pieces of about this many bytes, cut where no token can
#: span, so the partition's quadratic cost stays that of a small piece (measured:
#: docs/bench/figures.md §node.llama.boundaries).
PIECE_BYTES = 256
#: The longest stretch tokenized in one call (bytes): text no token boundary is
#: forced in (digits, CJK, ``<b><i>`` repeated) cannot be cut; its cost at this
#: size: docs/bench/figures.md §node.llama.boundaries.
MAX_PIECE_BYTES = 2 * 1024

_UTF8_CONTINUATION = 0x80  # 0b10xxxxxx: no character starts at such a byte


def hold_pairs(longest: np.ndarray, texts: list[bytes]) -> None:
    """Raises ``longest[x * 256 + y]`` to the length of each of ``texts`` holding x, y.

    ``longest`` starts as ones (256 * 256, int64); a vocabulary is read in chunks
    of texts, byte-fallback tokens left out (they cover one byte, hold no pair)."""
    data = np.frombuffer(b"".join(texts), dtype=np.uint8)
    sizes = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    owner_size = np.repeat(sizes, sizes)[:-1]  # the length of the text each pair starts in
    within = np.ones(max(data.size - 1, 0), dtype=bool)
    within[np.cumsum(sizes)[:-1][sizes[:-1] > 0] - 1] = False  # pairs across two texts
    pairs = data[:-1].astype(np.intp) * 256 + data[1:]
    np.maximum.at(longest, pairs[within], owner_size[within])


def spell_spaces(longest: np.ndarray) -> np.ndarray:
    """``pair_max`` from ``hold_pairs``' table: a pair of the prompt that holds a
    space appears in SentencePiece spelling as ``▁`` (E2 96 81), so its pairs
    count both ways."""
    table = longest.reshape(256, 256)
    left = np.arange(256)
    left[0x20] = 0x81  # a space ends as ▁'s last byte
    right = np.arange(256)
    right[0x20] = 0xE2  # and starts as its first
    pair_max: np.ndarray = np.maximum(table, table[left][:, right]).reshape(-1)
    return pair_max


def stretches(
    pair_max: np.ndarray,
    text: bytes,
    specials: Specials | None = None,
    longer: int = PIECE_BYTES,
) -> tuple[np.ndarray, np.ndarray]:
    """Where ``text``'s stretches between forced token boundaries start (byte
    offsets) and each one's lower bound (tokens; their sum bounds the text's).

    Boundaries are kept only before the first byte of a character, so a piece
    is valid UTF-8 and llama.cpp splits it into the same characters. With
    ``specials``, a stretch over ``longer`` bytes is also cut at both ends of
    each special-token text no other can overlap (``Specials``): those are
    token boundaries too, and each part still holds whole tokens.

    Why the bound holds: in llama.cpp every token of a text covers a stretch of it
    and its text (``llama_vocab_get_text``) spells that stretch: a special token
    exactly (the partition finds it by its text: a user-defined one always, a
    control one with parse_special, as the worker tokenizes), any other token in its
    SentencePiece form, where a space is ``▁`` (3 bytes), so never in fewer bytes
    than it covers; a byte-fallback token covers one byte. So a token covering
    k >= 2 bytes holds each adjacent pair of them in a token text of >= k bytes, and
    with ``pair_max[x, y]`` = the longest token text holding x, y adjacent (either
    spelling), byte j gets weight 1 / max(pair_max of its pair to the left, to the
    right) <= 1/k: one token's bytes weigh at most 1, and the text's weights sum to
    at most its tokens. A pair no token holds (pair_max 1) is a forced token
    boundary; every stretch between two of them holds whole tokens, so each stretch
    counts ceil(its weight) >= 1.
    Gemma 3: the longest token is 48 bytes (16 em dashes, box-drawing lines or
    ellipses); whitespace runs stop at 31 bytes; no token holds a letter or
    digit before a space, so every word starts a token, and newlines and
    tabs join nothing but themselves.
    """
    data = np.frombuffer(text, dtype=np.uint8)
    if data.size < 2:
        return np.zeros(data.size, np.int64), np.ones(data.size, np.int64)
    index = data[:-1].astype(np.intp) * 256 + data[1:]
    pair = pair_max[index]
    ones = np.ones(1, pair.dtype)
    reach = np.maximum(np.concatenate((ones, pair)), np.concatenate((pair, ones)))
    cut = (pair == 1) & (data[1:] & 0xC0 != _UTF8_CONTINUATION)
    if specials is not None:
        bounds = np.concatenate(([0], np.flatnonzero(cut) + 1, [data.size]))
        long = np.flatnonzero(np.diff(bounds) > longer)
        if long.size:  # mark the bytes of the long stretches
            edges = np.zeros(data.size + 1, np.int64)
            np.add.at(edges, bounds[long], 1)
            np.add.at(edges, bounds[long + 1], -1)
            specials.cut(text, index, cut, np.cumsum(edges)[:-1] > 0)
    starts = np.concatenate((np.zeros(1, np.int64), np.flatnonzero(cut) + 1))
    weight = np.add.reduceat(1.0 / reach, starts)
    # A float sum may land a hair above a whole number it should equal.
    lows = np.maximum(np.ceil(weight - 1e-6), 1).astype(np.int64)
    return starts, lows


def piece_spans(starts: np.ndarray, lows: np.ndarray, size: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, lower bound) of consecutive pieces of ``size`` bytes made of whole
    stretches (``starts``, ``lows``): each ends at the last stretch start at or
    before its begin + ``PIECE_BYTES``, or with its first stretch if that is longer."""
    bounds = np.concatenate((starts, [size]))
    low_before = np.concatenate(([0], np.cumsum(lows)))
    first = 0
    while first < len(starts):
        last = int(np.searchsorted(bounds, bounds[first] + PIECE_BYTES, side="right")) - 1
        last = max(last, first + 1)
        yield int(bounds[first]), int(bounds[last]), int(low_before[last] - low_before[first])
        first = last


class Specials:
    """The texts of some special tokens, as cutting a text into pieces needs them.

    llama.cpp's partition (``tokenizer_st_partition``) takes the special tokens
    longest text first (ties in no defined order: ``std::sort``) and cuts each
    one's leftmost non-overlapping occurrences out of what text is left; what
    is left is tokenized fragment by fragment. Where occurrences overlap, which
    one is cut out depends on that order; one that overlaps no other is always
    cut out, so both its ends are token boundaries. Such are the *segments* (the
    bytes between two pairs no text of the set holds) that are a text of the
    set holding no other (``simple``): no occurrence can overlap them.
    """

    def __init__(self, texts: Collection[bytes]) -> None:
        self.texts = frozenset(t for t in texts if t)
        self.longest = max(map(len, self.texts), default=0)
        self.pairs = np.zeros(256 * 256, dtype=bool)  # the byte pairs a text holds
        for text in self.texts:
            self.pairs[[x * 256 + y for x, y in pairwise(text)]] = True
        self._simple: dict[bytes, bool] = {}  # memo: a second or so for all texts

    def simple(self, text: bytes) -> bool:
        """Whether ``text`` is one of the texts and holds no other one."""
        if text not in self.texts:
            return False
        if text not in self._simple:
            n = len(text)  # any other text inside it?
            inner = (text[a:b] for a in range(n) for b in range(a + 1, n + 1) if b - a < n)
            self._simple[text] = not any(part in self.texts for part in inner)
        return self._simple[text]

    @functools.cached_property
    def _find(self) -> re.Pattern[bytes] | None:
        # A trie as a regular expression: a match costs its length whatever the
        # number of texts (thousands of control tokens in Gemma 3).
        return re.compile(trie(self.texts)) if self.texts else None

    def search(self, text: bytes, begin: int, end: int) -> bool:
        """Whether one of the texts occurs in ``text[begin:end]``."""
        return self._find is not None and self._find.search(text, begin, end) is not None

    def cut(self, text: bytes, index: np.ndarray, cut: np.ndarray, within: np.ndarray) -> None:
        """Sets ``cut`` (a cut before byte i + 1) at both ends of each simple
        segment of ``text`` that starts where ``within`` (per byte) is true.
        ``index`` is its byte pairs (x * 256 + y)."""
        n = len(text)
        bounds = np.concatenate(([0], np.flatnonzero(~self.pairs[index]) + 1, [n]))
        begins, ends = bounds[:-1], bounds[1:]
        pick = (ends - begins <= self.longest) & within[begins]
        ends_at = [
            p
            for a, b in zip(begins[pick].tolist(), ends[pick].tolist(), strict=True)
            if self.simple(text[a:b])
            for p in (a, b)
            if 0 < p < n
        ]
        cut[np.array(ends_at, dtype=np.intp) - 1] = True


def trie(texts: Collection[bytes]) -> bytes:
    """A regular expression matching the longest of ``texts`` (non-empty) at a position."""
    root: dict[int, Any] = {}
    for text in texts:
        node = root
        for byte in text:
            node = node.setdefault(byte, {})
        node[-1] = {}  # a text ends here

    def pattern(node: dict[int, Any]) -> bytes:
        branches = [re.escape(bytes([b])) + pattern(n) for b, n in sorted(node.items()) if b >= 0]
        if not branches:
            return b""
        body = branches[0] if len(branches) == 1 else b"(?:" + b"|".join(branches) + b")"
        return b"(?:" + body + b")?" if -1 in node else body

    return pattern(root)


def cuts_hold(
    pair_max: np.ndarray,
    specials: dict[bool, Specials],
    sample: bytes,
    ids: Callable[[bytes, bool], list[int]],
) -> bool:
    """Whether ``sample`` cut at every forced token boundary, and cut also around
    every text of ``specials[special]`` no other can overlap, gives the ids it
    gives whole, with and without parse_special (= ``special``).
    ``ids(text, parse_special)`` is the vocabulary's ``llama_tokenize`` without
    BOS/EOS.

    A vocabulary whose tokenizer adds a space before text that follows a cut
    (llama.cpp's ``add_space_prefix``, set for Llama 2) fails here.
    """

    def joined(starts: np.ndarray, parse_special: bool) -> list[int]:
        cuts = pairwise([*starts.tolist(), len(sample)])
        return [t for a, b in cuts for t in ids(sample[a:b], parse_special)]

    holds = True
    for special in (False, True):
        whole = ids(sample, special)
        holds &= joined(stretches(pair_max, sample)[0], special) == whole
        starts = stretches(pair_max, sample, specials[special], longer=0)[0]
        holds &= joined(starts, special) == whole
    return holds


def count_unparsed(
    pair_max: np.ndarray,
    specials: Specials,
    controls: Specials,
    piece: bytes,
    tokens: Callable[[bytes], int],
    calls: int,
) -> int | None:
    """The tokens of ``piece`` with parse_special (``specials``: every special
    token's text), counted without asking llama.cpp to parse it: the control-token
    texts (``controls``) the partition cuts out of it are one token each, and the
    runs between them hold none, so ``tokens`` (``llama_tokenize`` without
    parse_special) counts them the same. None when a control-token text in it may
    overlap another special text (then llama.cpp's order decides), or when it has
    more than ``calls`` runs.

    With parse_special the partition searches the text for each control token, at a
    cost per ``<`` in it (measured: docs/bench/figures.md §node.llama.boundaries).
    """
    starts = stretches(pair_max, piece, specials, longer=0)[0]
    found, run = 0, 0
    runs: list[tuple[int, int]] = []
    for a, b in pairwise([*starts.tolist(), len(piece)]):
        if not controls.search(piece, a, b):
            continue
        if not specials.simple(piece[a:b]):
            return None
        if run < a:
            runs.append((run, a))
        found, run = found + 1, b
    if run < len(piece):
        runs.append((run, len(piece)))
    if len(runs) > calls:
        return None
    return found + sum(tokens(piece[a:b]) for a, b in runs)


#: Checked at load (``cuts_hold``, ``Vocab._pieces_hold``): its pieces must give
#: the ids it gives whole. It holds what the bound's and the cuts' reasoning relies
#: on: spaces and runs of them, newlines, tabs, HTML tags (user-defined tokens in
#: Gemma 3) next to each other, a literal ▁, control-token text, CJK, emoji,
#: digits, code.
SAMPLE = (
    "The quick brown fox, 2024-11-29: jumps  over   the lazy dog.\n\n\tdef f(x):\n"
    "        return x ** 2  # square\n<table><tr><td>1</td></tr></table> <b><i>bold</i></b>"
    "\u2014\u2014\u2014 \u2581\u2581 \u2581x <start_of_turn>user<end_of_turn>"
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002 \U0001f600\U0001f600 "
    + " " * 40
    + "end\n" * 3
    + "\r\n\x00\x7f caf\u00e9 na\u00efve <b><i><b><i></td><td></td><td>a\na\n\n\t\n\t"
    "<unused7><b><pad>x\n\n<i>"
)
