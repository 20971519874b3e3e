"""A model's vocabulary through llama.cpp: the node's prompt-token counter, the
workers' tokenizing in pieces, and which tokens are special.

Part of the llama.cpp engine adapter (``node.llama.engine``, ``node.llama.log``):
the modules that import ``llama_cpp``. The node process loads a vocabulary
alone (no weights) once for the broker's 413 check; each worker wraps its
model's (``Vocab``) to tokenize prompts.

Tokenizing is not cheap: ~1 µs per byte of text, and time growing with the
square of the special-token matches (``node.llama.boundaries`` says why). So the
counter first bounds the count from the bytes and the vocabulary
(``Vocab.lower_bound``), and tokenizes only what the bound cannot decide, in
pieces, within ``LOOP_BYTES``; a worker tokenizes a whole prompt in pieces
(``Vocab.pieces``), which costs time linear in its length.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Iterator
from typing import Any

import llama_cpp.llama_cpp as llama_c
import numpy as np

from broker.client_request import ClientRequest
from broker.token_count import CHAT_TOKENS_PER_MESSAGE, TokenCount
from node.llama.boundaries import (
    MAX_PIECE_BYTES,
    PIECE_BYTES,
    SAMPLE,
    Specials,
    count_unparsed,
    cuts_hold,
    hold_pairs,
    piece_spans,
    spell_spaces,
    stretches,
)
from node.llama.log import LLAMA_LOG, LOG_ERROR

log = logging.getLogger(__name__)

#: Bytes of one request the counter tokenizes on the broker's loop at most; beyond
#: them, what the lower bound cannot refuse is left to the worker (which counts
#: anyway), a few ms of the loop (measured: docs/bench/figures.md §node.llama.vocab).
LOOP_BYTES = 4 * 1024
#: A piece with control-token text is counted in a ``llama_tokenize`` call per run
#: between them (``Vocab._piece_count``), at most one per this many bytes: a call
#: costs the same whatever its length (the partition walks every special token),
#: so this bounds the loop's cost (measured: docs/bench/figures.md §node.llama.vocab).
_CALL_BYTES = 16
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

    Loads only the GGUF's vocabulary (``Vocab.load``: a few MB, no weights; about
    a second, docs/bench/figures.md §node.llama.vocab), in the node process, once.
    ``chat`` prompts are counted as their contents plus ``CHAT_TOKENS_PER_MESSAGE``
    per message.

    Raises:
        ValueError: llama.cpp could not read the vocabulary (its error is logged).
    """
    return PromptCounter(Vocab.load(model_path))


class PromptCounter:
    """Counts a request's prompt tokens (a ``broker.token_count.TokenCounter``)."""

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
    for pieces (``_pair_lengths``, or the check on ``SAMPLE`` failed): then
    only whole texts are tokenized.
    """

    def __init__(self, vocab: llama_c.llama_vocab_p) -> None:
        self._vocab = vocab
        #: The ``llama_vocab`` pointer this reads.
        self.pointer = vocab
        self.added = self._tokens(b"", add_special=True)  # BOS (and EOS) every count has
        # What llama_tokenize's add_special puts around a text (SPM: llm_tokenizer_spm).
        bos, eos = llama_c.llama_vocab_bos(vocab), llama_c.llama_vocab_eos(vocab)
        self.bos = [bos] if llama_c.llama_vocab_get_add_bos(vocab) else []
        self.eos = [eos] if llama_c.llama_vocab_get_add_eos(vocab) else []
        self.pair_max, specials, hidden = _pair_lengths(vocab)
        #: Every special token id (``special_tokens``' rule), from the same pass.
        self.special = frozenset(hidden)
        user = [text for text, attr in specials if not attr & _CONTROL]
        self._specials = {False: Specials(user), True: Specials([t for t, _ in specials])}
        # A text a control token has needs parse_special, whatever else has it too.
        self._controls = Specials([text for text, attr in specials if attr & _CONTROL])
        # The longest token text (bytes): its pairs hold the table's largest entry.
        self.longest = 1 if self.pair_max is None else int(self.pair_max.max())
        if self.pair_max is not None and not self._pieces_hold(SAMPLE.encode()):
            log.warning("tokenizing in pieces fails on a sample; prompts are tokenized whole")
            self.pair_max, self.longest = None, 1

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
        """Tokens of ``text`` with BOS, as the worker counts them (llama-cpp-python
        tokenizes a str prompt with parse_special: ``<start_of_turn>`` is one token).
        Text with no control-token text is tokenized without parse_special (the
        same tokens; ~55 µs less per ``<`` in Gemma 3). BOS is added here: with
        add_special, llama.cpp logs a warning for each text starting with ``<bos>``.
        """
        parse = self._controls.search(text, 0, len(text))
        return self.added + self._tokens(text, parse_special=parse)

    def _tokens(self, text: bytes, parse_special: bool = False, add_special: bool = False) -> int:
        """``llama_tokenize``'s count: with no room it returns minus the number it needs."""
        n = llama_c.llama_tokenize(
            self._vocab, text, len(text), None, 0, add_special, parse_special
        )
        return -int(n) if n < 0 else int(n)

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
        each special-token text no other can overlap (``Specials``): no token
        spans a cut, and the partition's quadratic cost stays that of a piece
        (checked at load on ``SAMPLE``). A piece with no control-token text is
        tokenized without parse_special (the same ids), which spares the
        partition a search per control token, a cost per ``<`` in the piece. What no
        cut can split stays one piece: a run of one whitespace character costs
        time growing with the square of its tokens (measured: docs/bench/figures.md
        §node.llama.vocab).

        Raises:
            TooManyTokens: ``text`` has more than ``limit`` tokens: checked first
                from the bytes (``lower_bound``), then before each piece from the
                pieces' tokens and the bound of the rest.
        """
        assert self.pair_max is not None
        crude = -(-len(text) // self.longest)  # no token is longer
        if limit is not None and crude > limit:
            raise TooManyTokens(crude)
        starts, lows = stretches(self.pair_max, text, self._specials[special])
        counted, rest = 0, int(lows.sum())
        for begin, end, low in piece_spans(starts, lows, len(text)):
            if limit is not None and counted + rest > limit:
                raise TooManyTokens(counted + rest)
            parse = special and self._controls.search(text, begin, end)
            ids = self._ids(text[begin:end], parse)
            counted, rest = counted + len(ids), rest - low
            yield ids
        if limit is not None and counted > limit:
            raise TooManyTokens(counted)

    def lower_bound(self, text: bytes) -> int | None:
        """A lower bound on ``count(text)`` (tokens) from the bytes alone
        (``node.llama.boundaries.stretches`` says why it holds), or None when the
        vocabulary gives none (see ``_pair_lengths``)."""
        if self.pair_max is None:
            return None
        return self.added + int(stretches(self.pair_max, text)[1].sum())

    def bounded(self, text: bytes, limit: int) -> TokenCount:
        """Whether ``count(text)`` is at most ``limit`` tokens, within ``LOOP_BYTES``.

        Returns the exact count, or a lower bound that exceeds ``limit`` or could
        not be raised within the budget. Tokenizes in pieces cut at forced token
        boundaries (``lower_bound``): no token, special or merged, spans one, so
        the pieces' counts add up to the whole's (checked at load on ``SAMPLE``);
        it stops as soon as the counted pieces plus the bound of the rest exceed
        ``limit``. Control-token text is counted unparsed (``_piece_count``).
        """
        if self.pair_max is None:  # no bound, no cuts: only what is cheap whatever it holds
            short = len(text) <= PIECE_BYTES or (
                len(text) <= MAX_PIECE_BYTES and not self._controls.search(text, 0, len(text))
            )
            return TokenCount(self.count(text), True) if short else TokenCount(self.added, False)
        # No token is longer: this decides a 250 KB body in a microsecond.
        crude = self.added - (-len(text) // self.longest)
        if crude > limit:
            return TokenCount(crude, exact=False)
        starts, lows = stretches(self.pair_max, text)
        rest = int(lows.sum())
        counted = self.added
        if counted + rest > limit:
            return TokenCount(counted + rest, exact=False)
        budget = LOOP_BYTES
        for begin, end, low in piece_spans(starts, lows, len(text)):
            tokens = None
            if end - begin <= min(budget, MAX_PIECE_BYTES):
                budget -= end - begin
                tokens = self._piece_count(text[begin:end])
            if tokens is None:
                return TokenCount(counted + rest, exact=False)  # the worker decides
            counted, rest = counted + tokens, rest - low
            if counted + rest > limit:
                return TokenCount(counted + rest, exact=False)
        return TokenCount(counted, exact=True)

    def _piece_count(self, piece: bytes) -> int | None:
        """``count`` of ``piece`` without BOS at the cost of tokenizing it without
        parse_special (``node.llama.boundaries.count_unparsed``), or None."""
        assert self.pair_max is not None
        if not self._controls.search(piece, 0, len(piece)):
            return self._tokens(piece)
        calls = 1 + len(piece) // _CALL_BYTES
        every, controls = self._specials[True], self._controls
        return count_unparsed(self.pair_max, every, controls, piece, self._tokens, calls)

    def _pieces_hold(self, sample: bytes) -> bool:
        """Whether cutting ``sample`` holds (``node.llama.boundaries.cuts_hold``),
        ``bounded`` counts it exactly and ``lower_bound`` does not exceed that."""
        assert self.pair_max is not None
        holds = cuts_hold(self.pair_max, self._specials, sample, self._ids)
        low, count = self.lower_bound(sample), self.count(sample)
        exact = self.bounded(sample, count) == TokenCount(count, exact=True)
        return holds and exact and low is not None and low <= count


def around_text(llm: Any) -> tuple[list[int], list[int]]:
    """The tokens ``create_completion`` puts before and after a str prompt's ids
    (llama-cpp-python 0.3, ``Llama._create_completion``): CLS, else BOS, if the
    model adds BOS; SEP, else EOS, if it adds EOS or has a SEP."""
    model = llm._model
    cls, sep = model.token_cls(), model.token_sep()
    first = cls if cls != -1 else llm.token_bos()
    head = [first] if model.add_bos_token() and first != -1 else []
    tail = [sep if sep != -1 else llm.token_eos()] if model.add_eos_token() or sep != -1 else []
    return head, tail


#: llama_token_attr bits (llama.h) of tokens that are not text: llama.cpp's
#: ``llama_token_to_piece`` renders CONTROL only with ``special``, UNKNOWN and
#: UNUSED as placeholders.
_NOT_TEXT = (
    llama_c.LLAMA_TOKEN_ATTR_CONTROL
    | llama_c.LLAMA_TOKEN_ATTR_UNKNOWN
    | llama_c.LLAMA_TOKEN_ATTR_UNUSED
)
#: How special-token markers are spelled. llama.cpp renders USER_DEFINED tokens
#: even without ``special``, and some GGUFs mark markers so: the default model's
#: <start_of_image>, <end_of_image> and [multimodal] (seen in its output). Its
#: other user-defined tokens, HTML tags (<table>) and runs of spaces, are text.
_MARKER = re.compile(r"<\|.*\|>|<(?:start|end)_of_\w+>|\[\w+\]", re.DOTALL)


def is_special(attr: int, text: bytes) -> bool:
    """Whether a token with llama.cpp attributes ``attr`` and text ``text`` is
    special: an attribute in ``_NOT_TEXT``, or a user-defined token spelled like a
    marker (``_MARKER``)."""
    return bool(
        attr & _NOT_TEXT
        or (
            attr & llama_c.LLAMA_TOKEN_ATTR_USER_DEFINED
            and _MARKER.fullmatch(text.decode(errors="replace"))
        )
    )


def special_tokens(vocab: Vocab) -> tuple[frozenset[int], Any]:
    """(every special token id, the ids to mask at sampling as a numpy array).

    Special = ``is_special`` (``Vocab.special``, found in the pass that builds the
    vocabulary's tables: one pass over 262,144 tokens cost ~0.3 s, docs/bench/figures.md
    "Start to ready"). End-of-generation tokens (``llama_vocab_is_eog``) are special
    but not masked: the model must be able to stop.
    """
    special = vocab.special
    masked = sorted(t for t in special if not llama_c.llama_vocab_is_eog(vocab.pointer, t))
    return special, np.array(masked, dtype=np.intc)


def _pair_lengths(
    vocab: llama_c.llama_vocab_p,
) -> tuple[np.ndarray | None, list[tuple[bytes, int]], list[int]]:
    """(``pair_max``, the special tokens' texts and attributes, the ids ``is_special``
    says are special): for each byte pair
    x, y (index x * 256 + y), the length in bytes of the longest token text
    (``llama_vocab_get_text``) holding x, y adjacent, 1 if none; None when the
    bound of ``Vocab.lower_bound`` does not hold for this vocabulary.

    Only SentencePiece vocabularies (llama.cpp's SPM type: Gemma, Llama 2,
    Mistral) qualify: other types normalize text (WPM, UGM drop or fold
    characters) or may drop bytes their vocabulary lacks (BPE). Tokens with
    LSTRIP/RSTRIP make the partition drop the whitespace beside them, so they
    disqualify a vocabulary too. Byte-fallback tokens cover one byte and hold no
    pair (``node.llama.boundaries.hold_pairs``, ``spell_spaces``). The vocabulary is
    read in chunks: a worker builds this too, and its peak memory counts
    against its limit (Gemma 3: 262,144 tokens, 2.5 MB of text).
    """
    strip = llama_c.LLAMA_TOKEN_ATTR_LSTRIP | llama_c.LLAMA_TOKEN_ATTR_RSTRIP
    qualifies = llama_c.llama_vocab_type(vocab) == llama_c.LLAMA_VOCAB_TYPE_SPM
    longest = np.ones(256 * 256, dtype=np.int64)
    specials: list[tuple[bytes, int]] = []
    hidden: list[int] = []
    n = llama_c.llama_vocab_n_tokens(vocab)
    for first in range(0, n, 16_384):
        ids = range(first, min(n, first + 16_384))
        attrs = [int(llama_c.llama_vocab_get_attr(vocab, t)) for t in ids]
        texts = [llama_c.llama_vocab_get_text(vocab, t) or b"" for t in ids]
        specials += [(t, a) for t, a in zip(texts, attrs, strict=True) if a & _SPECIAL and t]
        hidden += [i for i, t, a in zip(ids, texts, attrs, strict=True) if is_special(a, t)]
        qualifies = qualifies and not any(attr & strip for attr in attrs)
        if qualifies:
            byte = llama_c.LLAMA_TOKEN_ATTR_BYTE
            hold_pairs(longest, [t for t, a in zip(texts, attrs, strict=True) if not a & byte])
    if not qualifies:
        return None, specials, hidden
    return spell_spaces(longest), specials, hidden
