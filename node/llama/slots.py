"""The per-sequence state of the batched llama engine (``node.llama.engine``), without llama.cpp.

A llama worker serves S slots from one model and one llama context: slot ``i``
is llama.cpp sequence ``i``, with ``n_ctx`` KV cells of its own (a non-unified
cache). This module owns what a slot remembers and how a request's output
becomes text; the engine owns the context and the batches.

* ``Slot``: the tokens whose KV the context holds for the sequence (kept after a
  request ends, for prompt prefix reuse) and the request it runs, if any.
* ``pick_slot``: the free slot whose cached tokens share the longest prefix with
  a new prompt (llama-server's ``cache_prompt``; it also prefers the least
  recently used slot among equals, as here).
* ``batch_order``: the order of the slots' rows in one batch, so that llama.cpp's
  split of it into ubatches never cuts a slot's rows, and cuts runs of decoding
  slots where the decode plan says (``node.llama.ubatch``).
* ``TextOut``: token bytes to text, one piece per token: UTF-8 split over byte
  tokens joins whole, and text that may begin a stop string is held back until
  it cannot (llama-cpp-python's ``create_completion`` does the same).
"""

from __future__ import annotations

import codecs
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from node.llama.ubatch import DecodePlan

#: Callback a request's partial text goes to (one call per piece of text).
Emit = Callable[[str], None]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class SlotJob:
    """One request running in a slot.

    ``prompt`` is every prompt token id (BOS included), of which the first
    ``reused`` were in the slot's KV cache already; ``next_token`` the token
    sampled last and not yet decoded (None during prompt evaluation).
    ``sampler`` is the request's own ``llama_sampler`` chain and ``grammar`` its
    ``json_schema``'s grammar sampler or None (ctypes pointers, kept apart:
    ``LlamaEngine._grammar_sample``), both freed by the engine when the request
    leaves its slot; ``greedy`` says the chain is the special-token mask and
    greedy only (the engine may pick its token itself).
    """

    rid: int
    prompt: list[int]
    max_tokens: int
    cancelled: threading.Event
    emit: Emit
    out: TextOut
    sampler: Any
    grammar: Any = None
    greedy: bool = False
    reused: int = 0
    generated: int = 0
    next_token: int | None = None
    #: A copy of its last logits row while its grammar waits for a later step
    #: (``LlamaEngine._sample``), and its place in that wait (lower: longer).
    saved: Any = None
    deferred: int = 0


@dataclass(eq=False)  # a slot is itself: identity, hashable
class Slot:
    """One llama.cpp sequence: ``seq`` is its id, ``cached`` the tokens at KV
    positions 0..len-1 (what a next request with the same prefix can skip),
    ``job`` the request it runs, ``used`` the engine's counter at its last start."""

    seq: int
    cached: list[int] = field(default_factory=list)
    job: SlotJob | None = None
    used: int = 0

    @property
    def prompt_left(self) -> int:
        """Prompt tokens its request still has to evaluate (0 without a request)."""
        return 0 if self.job is None else max(0, len(self.job.prompt) - len(self.cached))

    @property
    def prefilling(self) -> bool:
        """Whether its request still has prompt tokens to evaluate."""
        return self.prompt_left > 0


#: Fewest shared tokens worth reusing a slot for. Below it the least recently
#: used slot is taken, so a prompt that shares only BOS (or a word) with a
#: cached one does not evict the cache most likely to be asked for again
#: (a shared system prompt, between two requests that share nothing).
MIN_REUSE = 16


def pick_slot(slots: Sequence[Slot], prompt: Sequence[int], reuse: bool = True) -> tuple[Slot, int]:
    """The free slot to run ``prompt`` in, and how many of its cached tokens to keep.

    The free slot sharing the longest prefix with ``prompt`` wins if it shares at
    least ``MIN_REUSE`` tokens or the whole prompt (llama-server asks for half the prompt,
    ``--slot-prompt-similarity``; a long question after a shared system prompt
    would then never reuse it); else the least recently used one (never used
    first). At least the prompt's last token is evaluated again, since sampling
    needs its logits. Without ``reuse`` (a request's ``cache_prompt: false``) the
    free slot sharing the least is taken, so the caches most worth keeping stay,
    and nothing of it is kept: the whole prompt is evaluated from position 0.

    Raises:
        ValueError: no slot is free.
    """
    free = [s for s in slots if s.job is None]
    if not free:
        raise ValueError("no free slot")
    if not reuse:
        return min(free, key=lambda s: (common_prefix(s.cached, prompt), s.used)), 0
    best = max(free, key=lambda s: (common_prefix(s.cached, prompt), -s.used))
    shared = common_prefix(best.cached, prompt)
    if shared < MIN_REUSE and shared < len(prompt):  # a short prompt cached whole is reused
        best = min(free, key=lambda s: s.used)
    return best, min(common_prefix(best.cached, prompt), len(prompt) - 1)


def batch_order(rows: Mapping[int, int], plan: DecodePlan | None = None) -> list[int]:
    """The order of the sequences in one ``llama_batch``, each sequence's rows
    together, so that llama.cpp evaluates every prompt chunk whole in a ubatch of its
    own and the one-row sequences together in runs of consecutive ids. ``rows`` maps
    each sequence id in the step to its row count: 1 for a decoding slot, the
    chunk's length for a prompt chunk.

    Why: with a KV cache split per sequence, llama.cpp cuts a batch into ubatches
    of consecutive sequence ids with as many rows each (src/llama-batch.cpp,
    ``split_equal`` with ``sequential``, as ``llama_kv_cache_iswa::init_batch`` and
    ``llama_kv_cache::init_batch`` call it when not unified): a ubatch's set starts
    at the first unused row and takes each later row whose sequence is the last one
    taken + 1, and then the same number of rows from each sequence in the set. A
    prompt chunk in a set with a decoding sequence was cut into one row there and
    the rest in a later ubatch, and a prompt evaluated in other pieces rounds
    differently: on an AMD EPYC (Zen 4), two of twenty greedy prompts then wrote
    another text beside decoding slots than alone (tests/system/test_slots.py), and
    six of twenty arriving four at a time (docs/bench/figures.md, node.llama.batch).
    Two chunks of one length in one ubatch are not cut, but rounded differently too
    (two of those twenty); one-row sequences beside each other got their single-slot
    logits bit for bit.

    The order: runs of consecutive ids with one row each, and every longer chunk as
    a run of its own, the run with the highest ids first, each run ascending. A set
    then starts at a run's first sequence, takes the run whole and cannot go on:
    the next id belongs to a run placed before it, already used. So each run is one
    ubatch, and a step of decoding slots with consecutive ids is one ubatch, as in
    ascending order.

    ``plan`` (default: none, every run whole) cuts each run of decoding slots into
    the pieces it names (``node.llama.ubatch``): each piece is a run of its own,
    so one ubatch, placed as runs are.
    """
    runs: list[list[int]] = []
    for seq in sorted(rows):
        if runs and runs[-1][-1] == seq - 1 and rows[runs[-1][-1]] == rows[seq] == 1:
            runs[-1].append(seq)
        else:
            runs.append([seq])
    if plan is not None:
        runs = [piece for run in runs for piece in _cut(run, plan.cut(len(run)))]
    return [seq for run in reversed(runs) for seq in run]


def _cut(run: list[int], sizes: Sequence[int]) -> list[list[int]]:
    """``run`` in consecutive pieces of ``sizes`` (which sum to its length)."""
    pieces, at = [], 0
    for size in sizes:
        pieces.append(run[at : at + size])
        at += size
    return pieces


class TextOut:
    """A request's text, piece by piece, with stop strings and split characters handled.

    Args:
        stops: strings that end generation; none of their text is output.
        lstrip: drop whitespace before the first text (a plain ``Q:/A:`` chat's
            answer starts after ``A:``).
    """

    def __init__(self, stops: Sequence[str] = (), lstrip: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.lstrip = lstrip
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""
        self.pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything output so far."""
        return "".join(self.pieces)

    def feed(self, data: bytes) -> tuple[str, bool]:
        """Take one token's bytes; returns (text to output now, whether a stop string ended it)."""
        held = self._held + self._decoder.decode(data)
        if self.lstrip and not self.pieces:
            held = held.lstrip()
        hits = [i for i in (held.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return self._out(held[: min(hits)]), True
        keep = max((_overlap(held, s) for s in self.stops), default=0)
        self._held = held[len(held) - keep :] if keep else ""
        return self._out(held[: len(held) - keep]), False

    def flush(self) -> str:
        """At an end without a stop string: the text held back, and any half character."""
        rest = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return self._out(rest)

    def _out(self, text: str) -> str:
        if text:
            self.pieces.append(text)
        return text


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
