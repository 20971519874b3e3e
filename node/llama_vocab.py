"""The node's prompt-token counter: a model's vocabulary through llama.cpp, without weights.

Part of the llama.cpp engine adapter (``node.llama_engine``, ``node.llama_log``):
the modules that import ``llama_cpp``. The node process loads it once for the
broker's 413 check; workers never do.

The check runs on the broker's loop, and tokenizing is not cheap there: ~1 µs
per byte of text, and llama.cpp's special-token partition
(``tokenizer_st_partition`` in ``src/llama-vocab.cpp``) erases each match from a
linked list by walking it from the start, so text dense in user-defined tokens
(Gemma 3 has one per newline, tab and HTML tag) costs time growing with the
square of its length: 16 KB of ``"a\\n"`` took 0.95 s here, 250 KB of ordinary
words 0.2-0.3 s. So the counter first bounds the count from the bytes and the
vocabulary (``_Vocab.lower_bound``), and tokenizes only what the bound cannot
decide, in pieces, within ``LOOP_BYTES``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator
from itertools import pairwise

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


def make_token_counter(model_path: str) -> PromptCounter:
    """A prompt-token counter for the broker's 413 check, from the model's vocabulary.

    Loads only the GGUF's vocabulary (``_Vocab``: a few MB, no weights; ~1 s for
    Gemma 3's 262,144 tokens, and ~0.8 s more for the bound's tables), in the
    node process, once. ``chat`` prompts are counted as their contents plus
    ``CHAT_TOKENS_PER_MESSAGE`` per message.

    Raises:
        ValueError: llama.cpp could not read the vocabulary (its error is logged).
    """
    return PromptCounter(_Vocab(model_path))


class PromptCounter:
    """Counts a request's prompt tokens (a ``broker.admission.BoundedTokenCounter``)."""

    def __init__(self, vocab: _Vocab) -> None:
        self.vocab = vocab

    def __call__(self, req: ClientRequest) -> int:
        """The exact count, whatever it costs."""
        text, extra = _text(req)
        return self.vocab.count(text) + extra

    def bounded(self, req: ClientRequest, limit: int) -> TokenCount:
        """Enough to tell whether the prompt has at most ``limit`` tokens, within
        ``LOOP_BYTES`` of tokenizing (see ``_Vocab.bounded``)."""
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


class _Vocab:
    """A model's tokenizer alone, through llama.cpp's C API (llama.h).

    ``llama_cpp.Llama(vocab_only=True)`` would also make a context, whose
    check of n_ctx against the training context (never read in a vocab-only
    load, so 0) logs "n_ctx_train (0) -- possible training context overflow",
    and it hides llama.cpp's errors during the load (``verbose=False``
    redirects fd 2). Loading the vocabulary directly needs no context; the
    load's warnings are about the file (the workers' loads see them too) and
    are dropped, its errors are shown.
    """

    def __init__(self, model_path: str) -> None:
        params = llama_c.llama_model_default_params()
        params.vocab_only = True
        with LLAMA_LOG.at_level(LOG_ERROR):
            model = llama_c.llama_model_load_from_file(model_path.encode(), params)
        if not model:
            raise ValueError(f"llama.cpp could not read the vocabulary of {model_path}")
        self._vocab = llama_c.llama_model_get_vocab(model)
        # The node keeps its counter for its lifetime; free the model with it.
        weakref.finalize(self, llama_c.llama_model_free, model)
        self.added = self.count(b"")  # BOS (and EOS) that every count includes
        self.pair_max = _pair_lengths(self._vocab)
        if self.pair_max is not None and not self._bound_holds(_SAMPLE.encode()):
            log.warning("the prompt-token bound fails on a sample; prompts are counted whole")
            self.pair_max = None
        # The longest token text (bytes): its pairs hold the table's largest entry.
        self.longest = 1 if self.pair_max is None else int(self.pair_max.max())

    def count(self, text: bytes) -> int:
        """Tokens of ``text`` with BOS (as the worker's ``Llama.tokenize`` counts them).

        ``llama_tokenize`` with no room returns minus the number it needs.
        """
        return self._tokens(text, add_special=True)

    def _tokens(self, text: bytes, add_special: bool) -> int:
        n = int(llama_c.llama_tokenize(self._vocab, text, len(text), None, 0, add_special, False))
        return -n if n < 0 else n

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
        parts = self._stretches(text)
        return None if parts is None else self.added + int(parts[1].sum())

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
        parts = self._stretches(text)
        assert parts is not None
        starts, lows = parts
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

    def _stretches(self, text: bytes) -> tuple[np.ndarray, np.ndarray] | None:
        """Where ``text``'s stretches between forced token boundaries start (byte
        offsets) and each one's lower bound (tokens); None without ``pair_max``.

        Boundaries are kept only before the first byte of a character, so a piece
        is valid UTF-8 and llama.cpp splits it into the same characters.
        """
        if self.pair_max is None:
            return None
        data = np.frombuffer(text, dtype=np.uint8)
        if data.size < 2:
            return np.zeros(data.size, np.int64), np.ones(data.size, np.int64)
        pair = self.pair_max[data[:-1].astype(np.intp) * 256 + data[1:]]
        ones = np.ones(1, pair.dtype)
        reach = np.maximum(np.concatenate((ones, pair)), np.concatenate((pair, ones)))
        cut = (pair == 1) & (data[1:] & 0xC0 != _UTF8_CONTINUATION)
        starts = np.concatenate((np.zeros(1, np.int64), np.flatnonzero(cut) + 1))
        weight = np.add.reduceat(1.0 / reach, starts)
        # A float sum may land a hair above a whole number it should equal.
        lows = np.maximum(np.ceil(weight - 1e-6), 1).astype(np.int64)
        return starts, lows

    def _bound_holds(self, sample: bytes) -> bool:
        """Whether ``sample`` counted in pieces at every forced boundary adds up to
        its count whole, and ``lower_bound`` does not exceed it."""
        parts = self._stretches(sample)
        assert parts is not None
        cuts = pairwise([*parts[0].tolist(), len(sample)])
        pieces = sum(self._tokens(sample[a:b], add_special=False) for a, b in cuts)
        whole = self.count(sample)
        low = self.lower_bound(sample)
        return pieces + self.added == whole and low is not None and low <= whole


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


def _pair_lengths(vocab: llama_c.llama_vocab_p) -> np.ndarray | None:
    """``pair_max``: for each byte pair x, y (index x * 256 + y), the length in bytes
    of the longest token text holding x, y adjacent, 1 if none; None when the
    bound of ``_Vocab.lower_bound`` does not hold for this vocabulary.

    Only SentencePiece vocabularies (llama.cpp's SPM type: Gemma, Llama 2,
    Mistral) qualify: other types normalize text (WPM, UGM drop or fold
    characters) or may drop bytes their vocabulary lacks (BPE). Tokens with
    LSTRIP/RSTRIP make the partition drop the whitespace beside them, so they
    disqualify a vocabulary too. Byte-fallback tokens cover one byte and hold no
    pair. A pair of the prompt that holds a space appears in SentencePiece
    spelling as ``▁`` (E2 96 81): its pairs count both ways.
    """
    if llama_c.llama_vocab_type(vocab) != llama_c.LLAMA_VOCAB_TYPE_SPM:
        return None
    strip = llama_c.LLAMA_TOKEN_ATTR_LSTRIP | llama_c.LLAMA_TOKEN_ATTR_RSTRIP
    texts = []
    for token in range(llama_c.llama_vocab_n_tokens(vocab)):
        attr = llama_c.llama_vocab_get_attr(vocab, token)
        if attr & strip:
            return None
        if not attr & llama_c.LLAMA_TOKEN_ATTR_BYTE:
            texts.append(llama_c.llama_vocab_get_text(vocab, token) or b"")
    data = np.frombuffer(b"".join(texts), dtype=np.uint8)
    sizes = np.fromiter(map(len, texts), dtype=np.int64, count=len(texts))
    owner_size = np.repeat(sizes, sizes)[:-1]  # the length of the text each pair starts in
    within = np.ones(max(data.size - 1, 0), dtype=bool)
    within[np.cumsum(sizes)[:-1][sizes[:-1] > 0] - 1] = False  # pairs across two texts
    pairs = data[:-1].astype(np.intp) * 256 + data[1:]
    longest = np.ones(256 * 256, dtype=np.int64)
    np.maximum.at(longest, pairs[within], owner_size[within])
    table = longest.reshape(256, 256)
    left = np.arange(256)
    left[0x20] = 0x81  # a space ends as ▁'s last byte
    right = np.arange(256)
    right[0x20] = 0xE2  # and starts as its first
    return np.maximum(table, table[left][:, right]).reshape(-1)


#: Checked at load: the pieces of this text at every forced boundary must count
#: as the whole does. It holds what the bound's reasoning relies on: spaces and
#: runs of them, newlines, tabs, HTML tags (user-defined tokens in Gemma 3), a
#: literal ▁, control-token text, CJK, emoji, digits, code.
_SAMPLE = (
    "The quick brown fox, 2024-11-29: jumps  over   the lazy dog.\n\n\tdef f(x):\n"
    "        return x ** 2  # square\n<table><tr><td>1</td></tr></table> <b><i>bold</i></b>"
    "\u2014\u2014\u2014 \u2581\u2581 \u2581x <start_of_turn>user<end_of_turn>"
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002 \U0001f600\U0001f600 "
    + " " * 40
    + "end\n" * 3
    + "\r\n\x00\x7f caf\u00e9 na\u00efve"
)
