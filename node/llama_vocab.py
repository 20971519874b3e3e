"""A model's vocabulary through llama.cpp: the node's prompt-token counter, and
tokenizing in pieces for the workers.

Part of the llama.cpp engine adapter (``node.llama_engine``, ``node.llama_log``):
the modules that import ``llama_cpp``. The node process loads a vocabulary
alone (no weights) once for the broker's 413 check; each worker wraps its
model's (``Vocab``) to tokenize prompts.

Tokenizing is not cheap: ~1 µs per byte of text, and llama.cpp's special-token
partition (``tokenizer_st_partition`` in ``src/llama-vocab.cpp``) erases each
match from a linked list by walking it from the start, so text dense in
user-defined tokens (Gemma 3 has one per newline, tab and HTML tag) costs time
growing with the square of its length: 16 KB of ``"a\\n"`` took 0.95 s here,
64 KB 22 s (52 s through ``Llama.tokenize``, which tokenizes twice past 32,768
tokens), 250 KB of ordinary words 0.2-0.3 s. So the counter first bounds the
count from the bytes and the vocabulary (``Vocab.lower_bound``), and tokenizes
only what the bound cannot decide, in pieces, within ``LOOP_BYTES``; a worker
tokenizes a whole prompt in pieces (``Vocab.pieces``), which costs time linear
in its length.
"""

from __future__ import annotations

import functools
import logging
import re
import weakref
from collections.abc import Collection, Iterator
from itertools import pairwise
from typing import Any

import llama_cpp.llama_cpp as llama_c
import numpy as np

from broker.protocol import ClientRequest
from broker.service import CHAT_TOKENS_PER_MESSAGE
from broker.token_count import TokenCount
from node.llama_log import LLAMA_LOG, LOG_ERROR

log = logging.getLogger(__name__)

#: Bytes of one request the counter tokenizes on the broker's loop at most; beyond
#: them, what the lower bound cannot refuse is left to the worker (which counts
#: anyway). 4 KiB of ordinary text take ~3-5 ms here.
LOOP_BYTES = 4 * 1024
#: Text is tokenized in pieces of about this many bytes, cut where no token can
#: span, so the partition's quadratic cost stays that of a small piece: 4 KiB of
#: alternating newlines and tabs take ~125 ms whole, ~7 ms in 256-byte pieces.
PIECE_BYTES = 256
#: The longest stretch tokenized in one call (bytes): text no token boundary is
#: forced in (digits, CJK, ``<b><i>`` repeated) cannot be cut. 2 KiB of the worst
#: such text measured here (``<b><i>`` repeated) take ~4 ms.
MAX_PIECE_BYTES = 2 * 1024

_UTF8_CONTINUATION = 0x80  # 0b10xxxxxx: no character starts at such a byte
#: Tokens the special-token partition cuts out of a text (llama_token_attr, llama.h);
#: without parse_special it skips the CONTROL and UNKNOWN ones.
_SPECIAL = (
    llama_c.LLAMA_TOKEN_ATTR_CONTROL
    | llama_c.LLAMA_TOKEN_ATTR_USER_DEFINED
    | llama_c.LLAMA_TOKEN_ATTR_UNKNOWN
)
_CONTROL = llama_c.LLAMA_TOKEN_ATTR_CONTROL | llama_c.LLAMA_TOKEN_ATTR_UNKNOWN


def make_token_counter(model_path: str) -> PromptCounter:
    """A prompt-token counter for the broker's 413 check, from the model's vocabulary.

    Loads only the GGUF's vocabulary (``Vocab.load``: a few MB, no weights; ~1 s
    for Gemma 3's 262,144 tokens, and ~0.8 s more for the bound's tables), in the
    node process, once. ``chat`` prompts are counted as their contents plus
    ``CHAT_TOKENS_PER_MESSAGE`` per message.

    Raises:
        ValueError: llama.cpp could not read the vocabulary (its error is logged).
    """
    return PromptCounter(Vocab.load(model_path))


class PromptCounter:
    """Counts a request's prompt tokens (a ``broker.admission.BoundedTokenCounter``)."""

    def __init__(self, vocab: Vocab) -> None:
        self.vocab = vocab

    def __call__(self, req: ClientRequest) -> int:
        """The exact count, whatever it costs."""
        text, extra = _text(req)
        return self.vocab.count(text) + extra

    def bounded(self, req: ClientRequest, limit: int) -> TokenCount:
        """Enough to tell whether the prompt has at most ``limit`` tokens, within
        ``LOOP_BYTES`` of tokenizing (see ``Vocab.bounded``)."""
        text, extra = _text(req)
        found = self.vocab.bounded(text, limit - extra)
        return TokenCount(found.tokens + extra, found.exact)


def _text(req: ClientRequest) -> tuple[bytes, int]:
    """The text the counter tokenizes (UTF-8) and the tokens a chat template adds."""
    if req.prompt is not None:
        return req.prompt.encode(), 0
    messages = req.messages or ()
    text = "\n".join(content for _, content in messages)
    return text.encode(), CHAT_TOKENS_PER_MESSAGE * len(messages)


class TooManyTokens(Exception):
    """A text has more tokens than a limit; ``tokens`` is a lower bound on its count."""

    def __init__(self, tokens: int) -> None:
        super().__init__(f"at least {tokens} tokens")
        self.tokens = tokens


class Vocab:
    """A model's tokenizer through llama.cpp's C API (llama.h): counts, bounds,
    and token ids computed in pieces.

    Args:
        vocab: the model's ``llama_vocab`` pointer; whoever made it keeps the
            model alive as long as this object is used.

    ``pair_max`` is None when the vocabulary does not qualify for the bound or
    for pieces (``_pair_lengths``, or the check on ``_SAMPLE`` failed): then
    only whole texts are tokenized.
    """

    def __init__(self, vocab: llama_c.llama_vocab_p) -> None:
        self._vocab = vocab
        self.added = self.count(b"")  # BOS (and EOS) that every count includes
        # What llama_tokenize's add_special puts around a text (SPM: llm_tokenizer_spm).
        bos, eos = llama_c.llama_vocab_bos(vocab), llama_c.llama_vocab_eos(vocab)
        self.bos = [bos] if llama_c.llama_vocab_get_add_bos(vocab) else []
        self.eos = [eos] if llama_c.llama_vocab_get_add_eos(vocab) else []
        self.pair_max, specials = _pair_lengths(vocab)
        user = [text for text, attr in specials if not attr & _CONTROL]
        self._specials = {False: _Specials(user), True: _Specials([t for t, _ in specials])}
        # A text a control token has needs parse_special, whatever else has it too.
        self._controls = _Specials([text for text, attr in specials if attr & _CONTROL])
        if self.pair_max is not None and not self._pieces_hold(_SAMPLE.encode()):
            log.warning("tokenizing in pieces fails on a sample; prompts are tokenized whole")
            self.pair_max = None
        # The longest token text (bytes): its pairs hold the table's largest entry.
        self.longest = 1 if self.pair_max is None else int(self.pair_max.max())

    @classmethod
    def load(cls, model_path: str) -> Vocab:
        """The vocabulary of a GGUF file alone (no weights), freed with the object.

        ``llama_cpp.Llama(vocab_only=True)`` would also make a context, whose
        check of n_ctx against the training context (never read in a vocab-only
        load, so 0) logs "n_ctx_train (0) -- possible training context overflow",
        and it hides llama.cpp's errors during the load (``verbose=False``
        redirects fd 2). Loading the vocabulary directly needs no context; the
        load's warnings are about the file (the workers' loads see them too) and
        are dropped, its errors are shown.

        Raises:
            ValueError: llama.cpp could not read the vocabulary.
        """
        params = llama_c.llama_model_default_params()
        params.vocab_only = True
        with LLAMA_LOG.at_level(LOG_ERROR):
            model = llama_c.llama_model_load_from_file(model_path.encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not read the vocabulary of {model_path}")
        try:
            vocab = cls(llama_c.llama_model_get_vocab(model))
        except BaseException:
            llama_c.llama_model_free(model)
            raise
        # The node keeps its counter for its lifetime; free the model with it.
        weakref.finalize(vocab, llama_c.llama_model_free, model)
        return vocab

    def count(self, text: bytes) -> int:
        """Tokens of ``text`` with BOS (as the worker's ``Llama.tokenize`` counts them).

        ``llama_tokenize`` with no room returns minus the number it needs.
        """
        return self._tokens(text, add_special=True)

    def _tokens(self, text: bytes, add_special: bool) -> int:
        n = int(llama_c.llama_tokenize(self._vocab, text, len(text), None, 0, add_special, False))
        return -n if n < 0 else n

    def _ids(self, text: bytes, parse_special: bool) -> list[int]:
        """``llama_tokenize`` of ``text`` without BOS/EOS: every token covers at least
        one byte, so ``len(text)`` ids are room enough."""
        room = (llama_c.llama_token * max(len(text), 1))()
        n = llama_c.llama_tokenize(
            self._vocab, text, len(text), room, len(room), False, parse_special
        )
        if n < 0:
            raise RuntimeError(f"llama_tokenize needed {-n} tokens for {len(text)} bytes")
        return list(room[:n])

    def tokenize(self, text: bytes, special: bool, limit: int | None = None) -> list[int]:
        """The ids of ``Vocab.pieces``, joined."""
        return [token for ids in self.pieces(text, special, limit) for token in ids]

    def pieces(self, text: bytes, special: bool, limit: int | None = None) -> Iterator[list[int]]:
        """Token ids of ``text`` piece by piece, in time linear in its length: joined,
        exactly what ``llama_tokenize`` gives for the whole text without BOS/EOS
        (``add_special`` false, ``parse_special`` = ``special``). Only with ``pair_max``.

        The pieces (~``PIECE_BYTES``) are cut at forced token boundaries
        (``lower_bound``) and, in a stretch longer than a piece, at both ends of
        each special-token text no other can overlap (``_Specials``): no token
        spans a cut, and the partition's quadratic cost stays that of a piece
        (checked at load on ``_SAMPLE``). A piece with no control-token text is
        tokenized without parse_special (the same ids), which spares the
        partition a search per control token (6,250 in Gemma 3): with one, a
        piece costs ~50 µs per ``<`` in it (256 KB of ``<pad>``: 2.8 s). What no
        cut can split stays one piece: a run of one whitespace character costs
        time growing with the square of its tokens (31 bytes each in Gemma 3;
        256 KB of newlines: 0.2 s, of random words: 0.35 s).

        Raises:
            TooManyTokens: ``text`` has more than ``limit`` tokens: checked first
                from the bytes (``lower_bound``), then before each piece from the
                pieces' tokens and the bound of the rest.
        """
        assert self.pair_max is not None
        crude = -(-len(text) // self.longest)  # no token is longer
        if limit is not None and crude > limit:
            raise TooManyTokens(crude)
        starts, lows = self._stretches(text, self._specials[special])
        counted, rest = 0, int(lows.sum())
        for begin, end, low in _pieces(starts, lows, len(text)):
            if limit is not None and counted + rest > limit:
                raise TooManyTokens(counted + rest)
            parse = special and self._controls.search(text, begin, end)
            ids = self._ids(text[begin:end], parse)
            counted, rest = counted + len(ids), rest - low
            yield ids
        if limit is not None and counted > limit:
            raise TooManyTokens(counted)

    def lower_bound(self, text: bytes) -> int | None:
        """A lower bound on ``count(text)`` (tokens) from the bytes alone, or None
        when the vocabulary gives none (see ``_pair_lengths``).

        Why it holds: in llama.cpp every token of a text covers a stretch of it and
        its text (``llama_vocab_get_text``) spells that stretch: a user-defined token
        exactly (the partition finds it by its text), any other token in its
        SentencePiece form, where a space is ``▁`` (3 bytes), so never in fewer
        bytes than it covers; a byte-fallback token covers one byte. So a token
        covering k >= 2 bytes holds each adjacent pair of them in a token text of
        >= k bytes, and with ``pair_max[x, y]`` = the longest token text holding
        x, y adjacent (either spelling), byte j gets weight 1 / max(pair_max of its
        pair to the left, to the right) <= 1/k: one token's bytes weigh at most 1,
        and the text's weights sum to at most its tokens. A pair no token holds
        (pair_max 1) is a forced token boundary; every stretch between two of
        them holds whole tokens, so each stretch counts ceil(its weight) >= 1.
        Gemma 3: the longest token is 48 bytes (16 em dashes, box-drawing lines or
        ellipses); whitespace runs stop at 31 bytes; no token holds a letter or
        digit before a space, so every word starts a token, and newlines and
        tabs join nothing but themselves.
        """
        if self.pair_max is None:
            return None
        return self.added + int(self._stretches(text)[1].sum())

    def bounded(self, text: bytes, limit: int) -> TokenCount:
        """Whether ``count(text)`` is at most ``limit`` tokens, within ``LOOP_BYTES``.

        Returns the exact count, or a lower bound that exceeds ``limit`` or could
        not be raised within the budget. Tokenizes in pieces cut at forced token
        boundaries (``lower_bound``): no token, user-defined or merged, spans one,
        so the pieces' counts add up to the whole's (checked at load on
        ``_SAMPLE``); it stops as soon as the counted pieces plus the bound of the
        rest exceed ``limit``.
        """
        if len(text) <= PIECE_BYTES:
            return TokenCount(self.count(text), exact=True)
        if self.pair_max is None:  # no bound: only what is cheap whatever it holds
            if len(text) <= MAX_PIECE_BYTES:
                return TokenCount(self.count(text), exact=True)
            return TokenCount(self.added, exact=False)
        # No token is longer: this decides a 250 KB body in a microsecond.
        crude = self.added - (-len(text) // self.longest)
        if crude > limit:
            return TokenCount(crude, exact=False)
        starts, lows = self._stretches(text)
        rest = int(lows.sum())
        counted = self.added
        if counted + rest > limit:
            return TokenCount(counted + rest, exact=False)
        budget = LOOP_BYTES
        for begin, end, low in _pieces(starts, lows, len(text)):
            if end - begin > min(budget, MAX_PIECE_BYTES):
                return TokenCount(counted + rest, exact=False)  # the worker decides
            budget -= end - begin
            counted += self._tokens(text[begin:end], add_special=False)
            rest -= low
            if counted + rest > limit:
                return TokenCount(counted + rest, exact=False)
        return TokenCount(counted, exact=True)

    def _stretches(
        self, text: bytes, specials: _Specials | None = None, longer: int = PIECE_BYTES
    ) -> tuple[np.ndarray, np.ndarray]:
        """Where ``text``'s stretches between forced token boundaries start (byte
        offsets) and each one's lower bound (tokens). Only with ``pair_max``.

        Boundaries are kept only before the first byte of a character, so a piece
        is valid UTF-8 and llama.cpp splits it into the same characters. With
        ``specials``, a stretch over ``longer`` bytes is also cut at both ends of
        each special-token text no other can overlap (``_Specials``): those are
        token boundaries too, and each part still holds whole tokens.
        """
        assert self.pair_max is not None
        data = np.frombuffer(text, dtype=np.uint8)
        if data.size < 2:
            return np.zeros(data.size, np.int64), np.ones(data.size, np.int64)
        index = data[:-1].astype(np.intp) * 256 + data[1:]
        pair = self.pair_max[index]
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

    def _pieces_hold(self, sample: bytes) -> bool:
        """Whether ``sample`` cut at every forced token boundary gives the ids it
        gives whole (without parse_special, as the counter tokenizes), cut also
        around every special-token text no other can overlap the ids it gives
        whole with and without parse_special, and whether ``lower_bound`` does
        not exceed its count.

        A vocabulary whose tokenizer adds a space before text that follows a cut
        (llama.cpp's ``add_space_prefix``, set for Llama 2) fails here.
        """

        def joined(starts: np.ndarray, parse_special: bool) -> list[int]:
            cuts = pairwise([*starts.tolist(), len(sample)])
            return [t for a, b in cuts for t in self._ids(sample[a:b], parse_special)]

        holds = joined(self._stretches(sample)[0], False) == self._ids(sample, False)
        for special in (False, True):
            starts = self._stretches(sample, self._specials[special], longer=0)[0]
            holds &= joined(starts, special) == self._ids(sample, special)
        low = self.lower_bound(sample)
        return holds and low is not None and low <= self.count(sample)


def _pieces(starts: np.ndarray, lows: np.ndarray, size: int) -> Iterator[tuple[int, int, int]]:
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


class _Specials:
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
        self._simple: dict[bytes, bool] = {}  # memo: ~1 s for all of Gemma 3's

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
        # number of texts (Gemma 3 has 6,250 control tokens; ~0.15 s to compile).
        return re.compile(_trie(self.texts)) if self.texts else None

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


def _trie(texts: Collection[bytes]) -> bytes:
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


def _pair_lengths(
    vocab: llama_c.llama_vocab_p,
) -> tuple[np.ndarray | None, list[tuple[bytes, int]]]:
    """(``pair_max``, the special tokens' texts and attributes): for each byte pair
    x, y (index x * 256 + y), the length in bytes of the longest token text
    (``llama_vocab_get_text``) holding x, y adjacent, 1 if none; None when the
    bound of ``Vocab.lower_bound`` does not hold for this vocabulary.

    Only SentencePiece vocabularies (llama.cpp's SPM type: Gemma, Llama 2,
    Mistral) qualify: other types normalize text (WPM, UGM drop or fold
    characters) or may drop bytes their vocabulary lacks (BPE). Tokens with
    LSTRIP/RSTRIP make the partition drop the whitespace beside them, so they
    disqualify a vocabulary too. Byte-fallback tokens cover one byte and hold no
    pair. A pair of the prompt that holds a space appears in SentencePiece
    spelling as ``▁`` (E2 96 81): its pairs count both ways. The vocabulary is
    read in chunks: a worker builds this too, and its peak memory counts
    against its limit (Gemma 3: 262,144 tokens, 2.5 MB of text).
    """
    strip = llama_c.LLAMA_TOKEN_ATTR_LSTRIP | llama_c.LLAMA_TOKEN_ATTR_RSTRIP
    qualifies = llama_c.llama_vocab_type(vocab) == llama_c.LLAMA_VOCAB_TYPE_SPM
    longest = np.ones(256 * 256, dtype=np.int64)
    specials: list[tuple[bytes, int]] = []
    n = llama_c.llama_vocab_n_tokens(vocab)
    for first in range(0, n, 16_384):
        ids = range(first, min(n, first + 16_384))
        attrs = [int(llama_c.llama_vocab_get_attr(vocab, t)) for t in ids]
        texts = [llama_c.llama_vocab_get_text(vocab, t) or b"" for t in ids]
        specials += [(t, a) for t, a in zip(texts, attrs, strict=True) if a & _SPECIAL and t]
        qualifies = qualifies and not any(attr & strip for attr in attrs)
        if qualifies:
            byte = llama_c.LLAMA_TOKEN_ATTR_BYTE
            _hold_pairs(longest, [t for t, a in zip(texts, attrs, strict=True) if not a & byte])
    if not qualifies:
        return None, specials
    table = longest.reshape(256, 256)
    left = np.arange(256)
    left[0x20] = 0x81  # a space ends as ▁'s last byte
    right = np.arange(256)
    right[0x20] = 0xE2  # and starts as its first
    return np.maximum(table, table[left][:, right]).reshape(-1), specials


def _hold_pairs(longest: np.ndarray, texts: list[bytes]) -> None:
    """Raises ``longest[x * 256 + y]`` to the length of each of ``texts`` holding x, y."""
    data = np.frombuffer(b"".join(texts), dtype=np.uint8)
    sizes = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    owner_size = np.repeat(sizes, sizes)[:-1]  # the length of the text each pair starts in
    within = np.ones(max(data.size - 1, 0), dtype=bool)
    within[np.cumsum(sizes)[:-1][sizes[:-1] > 0] - 1] = False  # pairs across two texts
    pairs = data[:-1].astype(np.intp) * 256 + data[1:]
    np.maximum.at(longest, pairs[within], owner_size[within])


#: Checked at load (``Vocab._pieces_hold``): its pieces must give the ids it gives
#: whole. It holds what the bound's and the cuts' reasoning relies on: spaces and
#: runs of them, newlines, tabs, HTML tags (user-defined tokens in Gemma 3) next
#: to each other, a literal ▁, control-token text, CJK, emoji, digits, code.
_SAMPLE = (
    "The quick brown fox, 2024-11-29: jumps  over   the lazy dog.\n\n\tdef f(x):\n"
    "        return x ** 2  # square\n<table><tr><td>1</td></tr></table> <b><i>bold</i></b>"
    "\u2014\u2014\u2014 \u2581\u2581 \u2581x <start_of_turn>user<end_of_turn>"
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002 \U0001f600\U0001f600 "
    + " " * 40
    + "end\n" * 3
    + "\r\n\x00\x7f caf\u00e9 na\u00efve <b><i><b><i></td><td></td><td>a\na\n\n\t\n\t"
    "<unused7><b><pad>x\n\n<i>"
)
