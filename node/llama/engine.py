"""The llama.cpp engine: one model, one llama context, S slots decoded together.

Continuous batching through llama-cpp-python's low-level bindings (llama.h), as
llama.cpp's own server does it (tools/server: slots, ``update_slots``):

* the context is made with ``n_seq_max = S`` and ``S x pad256(model.n_ctx)``
  cells, not unified: every slot (llama.cpp sequence ``i``) has ``model.n_ctx``
  cells of its own, so one slot can never starve another of KV cache;
* each ``step`` builds one ``llama_batch``: the token each generating slot
  sampled last, and prompt chunks of the slots still evaluating their prompt,
  the shortest remaining first, up to ``n_batch`` tokens in all
  (``PROMPT_BESIDE_DECODE`` beside generating slots; under flash attention at
  most ``node.engine.FLASH_PROMPT_ROWS`` of one slot), in the order that keeps
  llama.cpp from cutting a chunk (``node.llama.slots.batch_order``). A new
  request joins at the next step, and a long prompt is evaluated over several
  steps while the other slots keep decoding, and while short prompts that came
  after it start;
* every request samples through its own ``llama_sampler`` chain (special-token
  mask, temperature/top_p/seed), except that a greedy one's token is the argmax
  of its logits row, and another one's chain runs over the row's top-K candidates
  only (the chain's token, without the chain's copy of the whole vocabulary:
  ``LlamaEngine._argmax``, ``LlamaEngine._top_k``). A ``json_schema``'s grammar
  judges the chain's token, and only a token it refuses makes it filter the
  whole vocabulary, within a CPU budget (``LlamaEngine._grammar_sample``), and
  once a step's grammars took ``GRAMMAR_STEP_S`` the step's other schema slots
  sample at a later step (``LlamaEngine._sample``);
  a finished, cancelled or failed request leaves its slot at once;
* a slot keeps its sequence's KV after a request: the next request goes to the
  free slot sharing the longest prompt prefix, and only the rest is evaluated
  (``node.llama.slots.pick_slot``; llama-server's ``cache_prompt``).

Cancellation reaches inside a step with prompt chunks: llama.cpp's abort
callback (checked by ggml-cpu after each graph node) stops ``llama_decode`` when
a request in the batch is cancelled; the batch's KV is then removed for every
slot in it, and the next step runs the others' tokens again. Their output does
not change: no token was sampled from the aborted batch. A step of decode tokens
only is short and runs without the callback; a cancel is seen before the next.

Prompts are tokenized in pieces (``node.llama.vocab.Vocab.pieces``), in time
linear in their length. Special tokens never reach a client's text: masked at
sampling (all but end-of-generation) and without text on the way out.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import json
import logging
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as llama_c
import numpy as np
from llama_cpp.llama_chat_format import (
    ChatFormatter,
    Jinja2ChatFormatter,
    LlamaChatCompletionHandlerNotFoundException,
    LlamaChatCompletionHandlerRegistry,
)

from broker.errors import (
    Cancelled,
    EdgeNodeError,
    InternalError,
    ProtocolError,
    TooLarge,
    Unavailable,
)
from node.engine import (
    FLASH_PROMPT_ROWS,
    GRAMMAR_CHUNK,
    Emit,
    EngineSpec,
    Outcome,
    flash_attn_on,
)
from node.llama.candidates import TopK
from node.llama.grammar import schema_grammar, trim_heap
from node.llama.log import LLAMA_LOG as _LOG
from node.llama.log import LOG_QUIET
from node.llama.slots import Slot, SlotJob, TextOut, batch_order, pick_slot
from node.llama.threads import WINDOW_S, Switch, ThreadPolicy, read_task_times
from node.llama.ubatch import DecodePlan
from node.llama.vocab import TooManyTokens, Vocab, around_text, special_tokens

log = logging.getLogger(__name__)

#: ``model.kv_type`` -> ggml_type (ggml.h), as llama_context_params.type_k/type_v take it.
KV_GGML_TYPES = {
    "f16": llama_cpp.GGML_TYPE_F16,
    "q8_0": llama_cpp.GGML_TYPE_Q8_0,
    "q4_0": llama_cpp.GGML_TYPE_Q4_0,
}
#: One line per KV cache (src/llama-kv-cache.cpp): "CPU KV buffer size =    30.00 MiB".
_KV_BUFFER = re.compile(r"KV buffer size\s*=\s*([0-9.]+) MiB")
#: llama.cpp pads a context to a multiple of 256 cells (GGML_PAD, src/llama-context.cpp).
CTX_PAD = 256
#: llama-cpp-python's ``create_completion`` defaults, kept so that a request means
#: what it meant with the one-sequence engine: temperature, top_k, min_p.
DEFAULT_TEMPERATURE = 0.8
TOP_K = 40
MIN_P = 0.05
#: llama.h LLAMA_DEFAULT_SEED: a random seed per sampler.
RANDOM_SEED = 0xFFFFFFFF
#: Most prompt tokens in a step that also decodes other slots' tokens, so that one
#: long prompt does not hold the other slots' streams for a whole n_batch chunk
#: (measured: docs/bench/figures.md §node.llama.engine).
PROMPT_BESIDE_DECODE = 128
#: How a request ends whose grammar admits no next token (``LlamaEngine._grammar_sample``).
DEAD_END = (
    "json_schema is not usable: its grammar admits no next character (a character range "
    "written backwards, such as [z-a], is one cause)"
)
#: s of the engine thread's CPU time that a grammar may take for one token: judging
#: the chain's token, filtering the vocabulary after a refusal, accepting the token.
#: The intent schema's filter takes 25-70 ms here; nested repetitions that
#: pass ``node.llama.grammar``'s checks, ``([a-z ]{1,16}){0,16}``, took 3 s for an
#: early token and minutes later on, holding every other slot of the worker
#: (docs/bench/figures.md §node.llama.grammar). CPU time, not wall time: a starved
#: host does not count.
GRAMMAR_BUDGET_S = 1.0
#: s of grammar work (the engine thread's CPU time) in one step after which the
#: step's other ``json_schema`` slots wait for the next step (``LlamaEngine._sample``).
#: Without it S costly requests sampling in one step paused the other slots for up to
#: S x GRAMMAR_BUDGET_S (three: 3.2 s; break-it pass, session 18); with it a step's
#: grammar work stays under this plus one token's (1.25 s). The intent schema's
#: refusals take 25-70 ms: four at once never wait.
GRAMMAR_STEP_S = 0.25
#: How a request ends whose grammar took more than ``GRAMMAR_BUDGET_S`` for a token.
TOO_COSTLY = (
    "json_schema is too costly to follow: its grammar took over {budget_ms} ms of CPU "
    "for one token (common causes: a repetition of a repeated group, "
    "such as ([a-z ]{{1,16}}){{0,16}}: write [a-z ]{{0,256}} or end the group with a "
    "separator its class does not match; an enum or anyOf of a thousand alternatives: "
    "shorten it)"
)
#: Bytes of one ``llama_token_data`` (id, logit, p): the stride of ``_grammar_filter``'s pieces.
_TOKEN_DATA_BYTES = ctypes.sizeof(llama_c.llama_token_data)
#: llama_decode's return code when the abort callback stopped it (llama.h).
DECODE_ABORTED = 2
#: Decode steps per ubatch size when the engine loads (``_ubatch_costs``): untimed
#: ones first (the first steps after a load ran 20-50 % slower here), then timed ones,
#: of which the fastest counts (outside work only ever adds time).
UBATCH_WARMUPS = 2
UBATCH_TIMINGS = 5
#: s; after a step this slow, decode-only steps run with the abort callback too. A
#: decode step takes 20-150 ms here (1-8 slots); one of seconds means the host
#: starves the worker's threads, and a cancel must not wait for the step to end:
#: the broker kills a worker that has not answered a CANCEL within
#: broker.cancel_grace_ms (2 s) as hung.
SLOW_STEP_S = 0.5


def kv_buffer_bytes(load_log: str) -> int | None:
    """Bytes of KV cache llama.cpp reports in a context's load log (all caches:
    Gemma 3 has a sliding-window one and a full one), to 0.01 MiB; None if none."""
    sizes = [float(m) for m in _KV_BUFFER.findall(load_log)]
    return round(sum(sizes) * 2**20) if sizes else None


class LlamaEngine:
    """Runs ``generate`` and ``chat`` requests on a GGUF model, ``spec.slots`` at a time.

    Args:
        spec: model path, ``n_ctx`` (tokens per slot), ``n_batch`` (tokens per
            step, all slots together), ``threads`` (the cores this worker may
            really use: llama-cpp-python's default of ``cpu_count()//2`` ignores
            affinity and CPU quotas), ``kv_type`` and ``flash_attn`` (``node.engine.flash_attn_on``)
            and ``slots``; with ``adaptive_threads`` the context computes on one
            thread while the host starves its threads (``node.llama.threads``).

    ``kv_cache_bytes`` is the KV cache llama.cpp allocated, from its load log
    (None if it printed none). ``compute_threads`` is the thread count llama.cpp
    computes with now: ``spec.threads``, or 1 while the host starves them. The
    worker drives ``submit`` and ``step`` from one thread; ``run`` serves one
    request alone.

    Raises:
        ValueError: llama.cpp could not load the model, or the chat format is unknown.
    """

    kind = "llama"

    def __init__(self, spec: EngineSpec) -> None:
        self.model = Path(spec.model_path).name
        if spec.kv_type not in KV_GGML_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_GGML_TYPES)}")
        kv = KV_GGML_TYPES[spec.kv_type]
        self.slots = max(1, spec.slots)
        self.n_ctx = -(-spec.n_ctx // CTX_PAD) * CTX_PAD  # per slot, as llama.cpp pads it
        self.n_batch = spec.n_batch
        self.flash_attn = flash_attn_on(spec.kv_type, spec.flash_attn)
        #: Most prompt tokens of one slot per step (FLASH_PROMPT_ROWS under flash attention).
        self.prompt_rows = min(self.n_batch, FLASH_PROMPT_ROWS) if self.flash_attn else self.n_batch
        with (
            _model_params(use_extra_bufts=spec.repack),
            _context_params(n_seq_max=self.slots),
            _LOG.capture() as load_log,
        ):
            # Typed as Any: the wrapper's return types are unions of str and dicts.
            self.llm: Any = llama_cpp.Llama(
                model_path=spec.model_path,
                n_ctx=self.n_ctx * self.slots,
                n_batch=spec.n_batch,
                n_threads=spec.threads,
                n_threads_batch=spec.threads,
                type_k=kv,
                type_v=kv,
                flash_attn=self.flash_attn,
                verbose=False,
            )
        self.kv_cache_bytes = kv_buffer_bytes("".join(load_log))
        self._ctx = self.llm.ctx
        self._mem = llama_c.llama_get_memory(self._ctx)
        self._vocab = llama_c.llama_model_get_vocab(self.llm.model)
        # The tables that let prompts be tokenized in pieces (docs/bench/figures.md
        # §node.llama.engine: their load time and heap), and the special tokens.
        self.vocab = Vocab(self._vocab)
        trim_heap()  # reading them freed heap that would stay resident
        self.hidden, masked = special_tokens(self.vocab)
        # Special tokens other than end-of-generation can never be sampled.
        self._mask = (llama_c.llama_logit_bias * len(masked))(
            *(llama_c.llama_logit_bias(int(token), float("-inf")) for token in masked)
        )
        self._n_vocab = llama_c.llama_vocab_n_tokens(self._vocab)
        self._masked = np.zeros(self._n_vocab, dtype=bool)
        self._masked[masked] = True
        self._candidates = TopK(self._masked, TOP_K)  # engine thread only: one buffer
        # The whole vocabulary as candidates, for grammar requests (``_grammar_sample``).
        self._all = (llama_c.llama_token_data * self._n_vocab)()
        self._all_view: Any = np.ctypeslib.as_array(self._all)
        self._ids = np.arange(self._n_vocab, dtype=np.int32)
        self._piece = ctypes.create_string_buffer(64)  # detokenize's, reused: engine thread only
        self._chat = _chat_formatter(self.llm, spec.chat_format)  # ValueError: unknown name
        self._slots = [Slot(seq) for seq in range(self.slots)]
        self._batch = llama_c.llama_batch_init(self.n_batch, 0, 1)
        #: How runs of decoding slots are cut into ubatches (``node.llama.ubatch``),
        #: from ``ubatch_s``: s per ubatch of 1..S one-row sequences, timed at load.
        self.plan = DecodePlan.together(self.slots)
        self.ubatch_s: dict[int, float] = {}
        if self.slots > 1 and self.n_batch >= self.slots:
            self.ubatch_s = self._ubatch_costs()
            self.plan = DecodePlan.from_costs(self.ubatch_s)
            log.info(
                "decode plan (slots decoding: ubatches): %s; ms per ubatch of 1..%d rows: %s",
                self.plan.describe(),
                self.slots,
                ", ".join(f"{s * 1000:.1f}" for s in self.ubatch_s.values()),
            )
        self._uses = itertools.count(1)
        self._in_batch: list[threading.Event] = []
        self.steps = 0
        self.aborts = 0  # batches stopped inside llama_decode by a cancel (not starved_aborts)
        # Keep a reference: ctypes frees the trampoline when the object dies.
        self._abort_cb = llama_cpp.ggml_abort_callback(self._should_abort)
        self._watching = True
        self._watch(False)
        self.last_step_s = 0.0  # s, wall time of the last llama_decode (SLOW_STEP_S)
        self.compute_threads = spec.threads
        self._policy = ThreadPolicy(spec.threads) if spec.adaptive_threads else None
        self._switch: Switch | None = None  # decided inside llama_decode, applied after it
        self._last_end = 0.0  # monotonic s at the end of the last llama_decode
        self.starved_aborts = 0  # batches stopped inside llama_decode to drop to one thread
        self._step_grammar_s = 0.0  # CPU s the current step spent on grammars (_sample)
        self._step_grammars = 0  # grammar samples in the current step
        self.grammar_deferrals = 0  # json_schema samples moved to a later step (_sample)

    def _ubatch_costs(self) -> dict[int, float]:
        """s per ``llama_decode`` of one ubatch of g one-row sequences (g = 1..S), the
        fastest of ``UBATCH_TIMINGS`` steps, sizes interleaved, after
        ``UBATCH_WARMUPS`` untimed passes (they page the weights in). Each row is a BOS
        at position 0 of sequence 0..g-1, removed after: the slots start empty, as
        they would without it. ~1.3 s of a 4-slot worker's load on one core here
        (docs/bench/figures.md, "Issue 10: the decode plan").

        Raises:
            ValueError: a step failed (llama_decode's code).
        """
        bos = llama_c.llama_vocab_bos(self._vocab)
        times: dict[int, list[float]] = {g: [] for g in range(1, self.slots + 1)}
        for timed in [False] * UBATCH_WARMUPS + [True] * UBATCH_TIMINGS:
            for g in times:
                for seq in range(g):  # ascending: one ubatch (``batch_order``)
                    _put(self._batch, seq, bos, 0, seq, True)
                self._batch.n_tokens = g
                began = time.perf_counter()
                code = llama_c.llama_decode(self._ctx, self._batch)
                took = time.perf_counter() - began
                for seq in range(g):
                    llama_c.llama_memory_seq_rm(self._mem, seq, 0, -1)
                if code != 0:
                    raise ValueError(f"llama_decode returned {code} timing a ubatch of {g}")
                if timed:
                    times[g].append(took)
        return {g: min(t) for g, t in times.items()}

    def _should_abort(self, _data: ctypes.c_void_p) -> bool:
        # ggml-cpu calls this after every graph node: it doubles as the proof
        # that computation advances (the worker's progress counter).
        self.steps += 1
        return any(flag.is_set() for flag in self._in_batch) or self._starved_inside()

    def _starved_inside(self) -> bool:
        """Inside a watched ``llama_decode``: whether the window that ended now
        completes a starved streak (``STARVED_WINDOWS``), so the step stops and runs
        again on one thread. A starved 2-thread step takes seconds (~15 s with two
        busy host loops); the work thrown away is at most the streak's windows."""
        policy = self._policy
        if policy is None or self.compute_threads == 1 or self._switch is not None:
            return False
        now = time.monotonic()
        if not policy.due(now):
            return False
        self._switch = policy.observe(now, read_task_times())
        if self._switch is not None and self._switch.threads < self.compute_threads:
            self.starved_aborts += 1
            return True
        return False

    def _before_decode(self, now: float) -> bool:
        """Before a step's ``llama_decode`` at ``now`` (monotonic s): a step after an
        idle gap begins the thread policy's window (the idle time says nothing of
        the host). Returns whether the step must run with the abort callback: a
        probe's window, so that a probe on a starved host ends inside its step."""
        policy = self._policy
        if policy is None:
            return False
        if now - self._last_end > WINDOW_S:
            policy.restart(now, read_task_times())
        return policy.probing

    def _adapt_threads(self, ended: float) -> None:
        """After a step's ``llama_decode``, at ``ended`` (monotonic s): feed the
        thread policy when a window is due, and apply its change (or the one
        ``_starved_inside`` decided)."""
        policy = self._policy
        if policy is None:
            return
        self._last_end = ended
        if self._switch is None and policy.due(ended):
            self._switch = policy.observe(ended, read_task_times())
        switch, self._switch = self._switch, None
        if switch is None or switch.threads == self.compute_threads:
            return
        llama_c.llama_set_n_threads(self._ctx, switch.threads, switch.threads)
        log.info(
            "compute threads %d -> %d (%s): the compute threads waited for a core %.0f%% "
            "of %.2f s%s",
            self.compute_threads,
            switch.threads,
            switch.reason,
            100 * switch.share,
            switch.window_s,
            f"; next probe in {switch.hold_s:.0f} s at the earliest" if switch.hold_s else "",
        )
        self.compute_threads = switch.threads

    def _watch(self, on: bool) -> None:
        """Install the abort callback for batches with prompt chunks, and for every
        batch after a step slower than ``SLOW_STEP_S``.

        A chunk of ``n_batch`` prompt tokens takes seconds on one core, so a
        cancel must reach inside it; a decode step ends within tens of ms, and the
        cancel is seen before the next one. Without the callback there, ggml's
        first thread no longer stops for the interpreter after each of a step's
        ~460 graph nodes while the others wait at its barrier. On a host that
        starves the worker a decode step takes seconds too (two busy host
        processes left one worker ~2 tokens in 30 s): then the callback is back
        until a step is fast.
        """
        if on != self._watching:
            callback = self._abort_cb if on else llama_cpp.ggml_abort_callback()  # NULL
            llama_cpp.llama_set_abort_callback(self._ctx, callback, ctypes.c_void_p())
            self._watching = on

    # ------------------------------------------------------------------ requests

    @property
    def busy(self) -> int:
        """Slots running a request."""
        return sum(s.job is not None for s in self._slots)

    def cached(self) -> list[list[int]]:
        """Per slot, the tokens whose KV the context holds (a copy)."""
        return [list(s.cached) for s in self._slots]

    def submit(self, rid: int, job: dict[str, Any], cancelled: threading.Event, emit: Emit) -> None:
        """Give ``job`` (a worker REQUEST body) a slot; it joins the batch at the next step.

        Raises:
            TooLarge: the prompt does not fit a slot's ``n_ctx``, or the schema is too big.
            ProtocolError: the ``json_schema`` cannot be used.
            Cancelled: ``cancelled`` was set while the prompt was tokenized.
            Unavailable: every slot is busy (the broker's credit prevents it).
        """
        if self.busy >= self.slots:
            raise Unavailable("worker has no free slot")
        prompt, stops, lstrip = self._prompt(job, cancelled)
        # Last: nothing to free if the prompt or the schema failed.
        grammar = self.grammar_sampler(job["json_schema"]) if "json_schema" in job else None
        sampler = self._sampler(job)
        slot, keep = pick_slot(self._slots, prompt, job.get("cache_prompt") is not False)
        if keep < len(slot.cached) and not llama_c.llama_memory_seq_rm(
            self._mem, slot.seq, keep, -1
        ):
            llama_c.llama_memory_seq_rm(self._mem, slot.seq, -1, -1)
            keep = 0
        del slot.cached[keep:]
        slot.used = next(self._uses)
        slot.job = SlotJob(
            greedy=_greedy(job),
            rid=rid,
            prompt=prompt,
            max_tokens=int(job.get("max_tokens", 128)),
            cancelled=cancelled,
            emit=emit,
            out=TextOut([*job.get("stop", []), *stops], lstrip=lstrip),
            sampler=sampler,
            grammar=grammar,
            reused=keep,
        )

    def run(self, job: dict[str, Any], cancelled: threading.Event, emit: Emit) -> dict[str, Any]:
        """Serve ``job`` alone, blocking until it ends (``node.engine.Engine.run``).

        Raises:
            EdgeNodeError: what the request ended with (``Cancelled``, ``TooLarge``, ...).
        """
        rid = -next(self._uses)  # never a broker's rid (those are positive)
        self.submit(rid, job, cancelled, emit)
        while True:
            for done, outcome in self.step():
                if done != rid:
                    continue
                if isinstance(outcome, EdgeNodeError):
                    raise outcome
                return outcome

    def step(self) -> list[tuple[int, Outcome]]:
        """One batch: cancelled requests leave, the others advance by one decode
        step or one prompt chunk. Returns the requests that ended, with their outcome."""
        ended: list[tuple[int, Outcome]] = []
        for slot in self._slots:
            if slot.job is not None and slot.job.cancelled.is_set():
                during = " during prompt evaluation" if slot.prefilling else ""
                why = Cancelled(f"cancelled{during}", partial_text=slot.job.out.text)
                ended.append(self._end(slot, why))
        self._step_grammar_s, self._step_grammars = 0.0, 0
        ended += self._sample_deferred()
        rows = self._fill_batch()
        if not rows:
            return ended
        batch_slots = list(dict.fromkeys(slot for slot, _, _ in rows))
        self._in_batch = [s.job.cancelled for s in batch_slots if s.job is not None]
        prompt_chunk = any(len(tokens) > 1 for _, tokens, _ in rows)
        began = time.monotonic()
        probe, starved_before = self._before_decode(began), self.starved_aborts
        self._watch(prompt_chunk or self.last_step_s >= SLOW_STEP_S or probe)
        try:
            code = llama_c.llama_decode(self._ctx, self._batch)
        finally:
            self._in_batch = []
            done_at = time.monotonic()
            self.last_step_s = done_at - began
        self._adapt_threads(done_at)
        self.steps += 1
        if code != 0:
            # Aborted or failed: none of the batch's tokens count. Remove what it
            # may have left in the KV cache, so each slot resumes where it was.
            for slot in batch_slots:
                llama_c.llama_memory_seq_rm(self._mem, slot.seq, len(slot.cached), -1)
            self.aborts += code == DECODE_ABORTED and self.starved_aborts == starved_before
            if code != DECODE_ABORTED:
                error = InternalError(f"llama.cpp decode failed (llama_decode returned {code})")
                ended += [self._end(s, error) for s in batch_slots if s.job is not None]
            return ended
        for slot, tokens, logits_at in rows:
            slot.cached += tokens
            if logits_at is None:
                continue
            logits = self._logits(logits_at)
            if logits is None:
                error = InternalError(f"llama.cpp has no logits for batch row {logits_at}")
                ended.append(self._end(slot, error))
            elif (outcome := self._sample(slot, logits)) is not None:
                ended.append(outcome)
        return ended

    def _sample_deferred(self) -> list[tuple[int, Outcome]]:
        """Before a step's batch: sample the slots whose grammar waited (``_sample``),
        longest waiting first, within the step's ``GRAMMAR_STEP_S``; those sampled
        join the batch. Returns the requests that ended."""
        ended: list[tuple[int, Outcome]] = []
        waiting = [s for s in self._slots if s.job is not None and s.job.saved is not None]
        for slot in sorted(waiting, key=lambda s: s.job.deferred if s.job else 0):
            assert slot.job is not None and slot.job.saved is not None
            if self._grammar_waits():
                break
            logits, slot.job.saved = slot.job.saved, None
            if (outcome := self._sample(slot, logits)) is not None:
                ended.append(outcome)
        return ended

    def _fill_batch(self) -> list[tuple[Slot, list[int], int | None]]:
        """Fill the batch with ``_step_tokens``, each slot's rows together in
        ``batch_order``. Returns per slot (its tokens, its logits row or None)."""
        tokens = self._step_tokens()
        rows: list[tuple[Slot, list[int], int | None]] = []
        n = 0
        for seq in batch_order({seq: len(chunk) for seq, chunk in tokens.items()}, self.plan):
            slot, chunk = self._slots[seq], tokens[seq]
            assert slot.job is not None
            start = len(slot.cached)
            # A decode token's logits are always wanted; a chunk's only at its prompt's end.
            last = slot.job.next_token is not None or start + len(chunk) == len(slot.job.prompt)
            for i, token in enumerate(chunk):
                _put(self._batch, n + i, token, start + i, seq, last and i == len(chunk) - 1)
            rows.append((slot, chunk, n + len(chunk) - 1 if last else None))
            n += len(chunk)
        self._batch.n_tokens = n
        return rows

    def _step_tokens(self) -> dict[int, list[int]]:
        """The tokens of the next step, by slot: each generating slot's last sampled
        token, and prompt chunks, the shortest remaining prompt first."""
        tokens: dict[int, list[int]] = {}
        for slot in self._slots:
            if slot.job is not None and slot.job.next_token is not None:
                tokens[slot.seq] = [slot.job.next_token]
        n = decoding = len(tokens)
        # Shortest remaining prompt first (then arrival): a short prompt that arrives
        # while a long one is being evaluated starts at the next step instead of after
        # the long one's last chunk; the long one still gets the rest of every step.
        waiting = sorted(
            (s for s in self._slots if s.prefilling), key=lambda s: (s.prompt_left, s.used)
        )
        # Beside generating slots a step carries fewer prompt tokens, so their
        # streams pause for a fraction of a second, not for a whole n_batch chunk.
        limit = self.n_batch if n == 0 else min(self.n_batch, n + PROMPT_BESIDE_DECODE)
        for slot in waiting:
            assert slot.job is not None
            # A chunk as long as the slot would take alone, so that its prompt is cut
            # where it is cut alone and rounds alike (``batch_order``). Only the step's
            # first chunk may be cut short to fit (without flash attention prompt_rows
            # is n_batch, more than a step beside generating slots may carry).
            size = min(slot.prompt_left, self.prompt_rows)
            if n + size > limit:
                if n > decoding:
                    break
                size = limit - n
            if size <= 0:
                break
            start = len(slot.cached)
            tokens[slot.seq] = slot.job.prompt[start : start + size]
            n += size
        return tokens

    def _sample(self, slot: Slot, logits: np.ndarray) -> tuple[int, Outcome] | None:
        """Sample ``slot``'s next token from ``logits`` (its row, shape ``(n_vocab,)``);
        its end, if it ended.

        A ``json_schema`` slot whose step already spent ``GRAMMAR_STEP_S`` on grammars
        keeps a copy of its row (1 MiB for Gemma 3) and samples it at the start of a
        later step (``_sample_deferred``): one step carries one costly grammar's pause,
        not every costly slot's. Its request is one step later; its token is the same.
        """
        job = slot.job
        assert job is not None
        if job.grammar is None:
            token = self._chain_sample(job, logits)
        elif self._grammar_waits():
            job.saved, job.deferred, job.next_token = logits.copy(), next(self._uses), None
            self.grammar_deferrals += 1
            return None
        else:
            began = time.thread_time()
            try:
                token = self._grammar_sample(job, logits)
            except EdgeNodeError as error:
                error.partial_text = job.out.text  # what the request wrote before its end
                return self._end(slot, error)
            finally:
                self._step_grammar_s += time.thread_time() - began
                self._step_grammars += 1
        if llama_c.llama_vocab_is_eog(self._vocab, token):
            return self._finish(slot, "stop", flush=True)
        job.generated += 1
        text, stopped = job.out.feed(self.detokenize([token]))
        if text:
            job.emit(text)
        if stopped:
            return self._finish(slot, "stop", flush=False)
        if job.generated >= job.max_tokens or len(slot.cached) >= self.n_ctx:
            return self._finish(slot, "length", flush=True)
        job.next_token = token
        return None

    def _grammar_waits(self) -> bool:
        """Whether a ``json_schema`` slot's sample waits for a later step: this step's
        grammars took ``GRAMMAR_STEP_S`` already. The first of a step always runs."""
        return self._step_grammars > 0 and self._step_grammar_s >= GRAMMAR_STEP_S

    def _chain_sample(self, job: SlotJob, logits: np.ndarray) -> int:
        """The token ``job``'s chain picks from ``logits``, accepted into it:
        ``_argmax`` or ``_top_k``, or the chain over the whole vocabulary where they
        cannot tell (``_whole_chain``).

        Raises:
            InternalError: the chain selected no token.
        """
        token = self._argmax(logits) if job.greedy else self._top_k(job, logits)
        if token is not None:
            return token
        self._fill_all(logits)
        token = self._whole_chain(job)
        if token is None:
            raise InternalError("the sampler chain selected no token")
        return token

    def _fill_all(self, logits: np.ndarray) -> None:
        """``self._all`` := every token of the vocabulary with its logit, as
        ``llama_sampler_sample`` builds its candidates (ids in order, p 0)."""
        # Every field afresh: the chain sorts and truncates the array in place.
        self._all_view["id"] = self._ids
        self._all_view["logit"] = logits
        self._all_view["p"] = 0.0

    def _whole_chain(self, job: SlotJob) -> int | None:
        """``job``'s chain over ``self._all`` (``_fill_all``), its token accepted into
        the chain: what ``llama_sampler_sample`` does with a context's row (the
        vendored src/llama-sampler.cpp), on an array the grammar may have filtered.
        None when the chain selected nothing or a -inf logit (every token refused)."""
        array = llama_c.llama_token_data_array(self._all, self._n_vocab, -1, False)
        llama_c.llama_sampler_apply(job.sampler, ctypes.byref(array))
        at = array.selected
        if not (0 <= at < array.size and math.isfinite(array.data[at].logit)):
            return None
        token = int(array.data[at].id)
        llama_c.llama_sampler_accept(job.sampler, token)
        return token

    def _grammar_sample(self, job: SlotJob, logits: np.ndarray) -> int:
        """The token ``job``'s chain picks from ``logits`` among those its
        grammar admits, accepted into both.

        As llama.cpp's own sampler does it (common/sampling.h, llama-server's
        default): the grammar first judges the chain's token alone, and only when
        it refuses it does it filter the whole vocabulary (262,144 tokens), after
        which the chain picks again. Greedy requests get the token they got with
        the grammar first; sampled ones draw again after a refusal (another draw
        from the seeded generator, as llama-server's do). Filtering is the grammar's
        whole cost: 25-70 ms for the intent schema, seconds to minutes for an
        ambiguous pattern, so it runs within ``GRAMMAR_BUDGET_S`` (``_grammar_filter``).

        ``llama_sampler_sample`` would accept whatever the chain selected, and when
        the grammar has set every logit to -inf (a character range written
        backwards, ``[z-a]``; a U+0000 no token holds) that is token 0, whose
        acceptance throws in llama.cpp's grammar ("Unexpected empty grammar stack
        after accepting piece"): the worker died of SIGABRT with every slot on it.
        So a -inf choice is never accepted.

        Raises:
            ProtocolError: the grammar admits no token at all (``DEAD_END``).
            TooLarge: the token's grammar work took more than ``GRAMMAR_BUDGET_S``
                (``TOO_COSTLY``).
            InternalError: the chain selected no token (``_chain_sample``).
        """
        began = time.thread_time()
        token = self._chain_sample(job, logits)
        one = llama_c.llama_token_data(token, 1.0, 0.0)
        alone = llama_c.llama_token_data_array(ctypes.pointer(one), 1, -1, False)
        llama_c.llama_sampler_apply(job.grammar, ctypes.byref(alone))
        if not math.isfinite(one.logit):
            self._fill_all(logits)
            self._grammar_filter(job.grammar, began)
            chosen = self._whole_chain(job)
            if chosen is None:
                raise ProtocolError(DEAD_END)
            token = chosen
        llama_c.llama_sampler_accept(job.grammar, token)
        # Judging and accepting a token are single llama.cpp calls, not stopped midway;
        # their cost grows with the text (twelve adjacent [a-z]{0,256} runs: 2-6 s per
        # token after 250 characters, no refusal, so no filter; break-it pass, session
        # 18). The token that crosses the budget ends the request.
        if time.thread_time() - began > GRAMMAR_BUDGET_S:
            raise TooLarge(TOO_COSTLY.format(budget_ms=round(GRAMMAR_BUDGET_S * 1000)))
        return token

    def _grammar_filter(self, grammar: Any, began: float) -> None:
        """Apply ``grammar`` to the whole vocabulary in ``self._all`` (its refused
        tokens' logits become -inf), ``GRAMMAR_CHUNK`` tokens at a time.

        Raises:
            TooLarge: the token's grammar work since ``began`` (``time.thread_time``)
                took more than ``GRAMMAR_BUDGET_S``; the worker's other slots waited
                at most that and one chunk more.
        """
        base = ctypes.addressof(self._all)
        for start in range(0, self._n_vocab, GRAMMAR_CHUNK):
            data = ctypes.cast(base + start * _TOKEN_DATA_BYTES, llama_c.llama_token_data_p)
            size = min(GRAMMAR_CHUNK, self._n_vocab - start)
            part = llama_c.llama_token_data_array(data, size, -1, False)
            llama_c.llama_sampler_apply(grammar, ctypes.byref(part))
            if time.thread_time() - began > GRAMMAR_BUDGET_S:
                raise TooLarge(TOO_COSTLY.format(budget_ms=round(GRAMMAR_BUDGET_S * 1000)))

    def _argmax(self, logits: np.ndarray) -> int | None:
        """The token a greedy chain (special-token mask, then ``llama_sampler_init_greedy``)
        picks from ``logits``, or None if only that chain can tell.

        ``llama_sampler_sample`` copies all the vocabulary's logits into candidates
        (262,144 for Gemma 3) and scans them once per sampler: about 1 ms of the
        engine thread per token, which delays the next decode of every slot
        (docs/bench/figures.md, "Issue 10"). Here one vectorised argmax over the
        logits row does it. Greedy takes the first of equal maxima, as ``argmax``
        does; masking only lowers masked tokens, so the unmasked maximum is the
        chain's answer. A masked or NaN maximum goes to the chain (its rules for
        those are its own); neither chain sampler keeps state, so skipping
        ``llama_sampler_accept`` changes nothing.
        """
        token = int(logits.argmax())
        if self._masked[token] or logits[token] != logits[token]:
            return None
        return token

    def _top_k(self, job: SlotJob, logits: np.ndarray) -> int | None:
        """The token ``job``'s chain (mask, top_k, top_p, min_p, temperature, seeded
        draw; no grammar) picks from ``logits``, accepted into the chain; or None,
        the chain untouched, if only the whole vocabulary can tell (``_whole_chain``).

        The chain runs over the row's ``TOP_K`` highest unmasked logits instead of
        all 262,144 (``node.llama.candidates``: why each sampler gives the same
        token, and when it declines: a NaN, or equal logits among the K+1 highest).
        A ``json_schema`` request's grammar judges the token after (``_grammar_sample``).
        """
        return self._candidates.sample(job.sampler, logits)

    def _logits(self, row: int) -> np.ndarray | None:
        """Batch row ``row``'s logits (a view, shape ``(n_vocab,)``), None if it has none."""
        pointer = llama_c.llama_get_logits_ith(self._ctx, row)
        return np.ctypeslib.as_array(pointer, shape=(self._n_vocab,)) if pointer else None

    def _finish(self, slot: Slot, reason: str, flush: bool) -> tuple[int, Outcome]:
        job = slot.job
        assert job is not None
        if flush and (rest := job.out.flush()):
            job.emit(rest)
        usage = {
            "prompt_tokens": len(job.prompt),
            "completion_tokens": job.generated,
            "cached_tokens": job.reused,
        }
        return self._end(slot, {"text": job.out.text, "finish_reason": reason, "usage": usage})

    def _end(self, slot: Slot, outcome: Outcome) -> tuple[int, Outcome]:
        """Free ``slot`` (its KV stays, for prefix reuse) and say how its request ended."""
        job = slot.job
        assert job is not None
        slot.job = None
        llama_c.llama_sampler_free(job.sampler)
        if job.grammar is not None:
            llama_c.llama_sampler_free(job.grammar)
            trim_heap()  # else the grammar sampler's freed vectors stay resident
        return job.rid, outcome

    def close(self) -> None:
        """Free the batch, the requests' samplers and the model."""
        for slot in self._slots:
            if slot.job is not None:
                self._end(slot, Cancelled("engine closed"))
        llama_c.llama_batch_free(self._batch)
        self.llm.close()

    # ------------------------------------------------------------------ text

    def detokenize(self, tokens: list[int]) -> bytes:
        """The bytes of ``tokens`` as a client sees them: special tokens have none."""
        out = bytearray()
        buf = self._piece
        for token in tokens:
            if token in self.hidden:
                continue
            n = llama_c.llama_token_to_piece(self._vocab, token, buf, len(buf), 0, False)
            if n < 0:  # longer than the buffer: -n bytes
                long = ctypes.create_string_buffer(-n)
                n = llama_c.llama_token_to_piece(self._vocab, token, long, len(long), 0, False)
                out += long.raw[:n]
                continue
            out += buf.raw[:n]
        return bytes(out)

    def _prompt(
        self, job: dict[str, Any], cancelled: threading.Event
    ) -> tuple[list[int], list[str], bool]:
        """(prompt token ids, the chat format's stop strings, whether to lstrip the answer)."""
        if job["op"] != "chat":
            return self.prompt_ids(job["prompt"], cancelled), [], False
        if self._chat is None:
            return self.prompt_ids(qa_prompt(job["messages"]), cancelled), QA_STOPS, True
        rendered = self._chat(messages=job["messages"])
        stops = rendered.stop if isinstance(rendered.stop, list) else [rendered.stop or ""]
        head = [] if rendered.added_special else self.vocab.bos
        return head + self.prompt_ids(rendered.prompt, cancelled, around=False), stops, False

    def prompt_ids(self, text: str, cancelled: threading.Event, around: bool = True) -> list[int]:
        """``text``'s token ids (parse_special, as llama-cpp-python tokenizes a str
        prompt), tokenized in pieces with the tokens ``around_text`` puts around a
        completion's prompt. Each piece is a compute step (the worker's progress)
        and a point where a cancel is seen.

        Raises:
            TooLarge: the prompt leaves no room in a slot's ``n_ctx`` (413), found
                from its bytes or its first pieces before anything is evaluated.
            Cancelled: the request was cancelled meanwhile.
        """
        head, tail = around_text(self.llm) if around else ([], [])
        room = self.n_ctx - 1 - len(head) - len(tail)  # at least one token to generate
        ids = list(head)
        try:
            for piece in self.vocab.pieces(text.encode(), special=True, limit=room):
                ids += piece
                self.steps += 1
                if cancelled.is_set():
                    raise Cancelled("cancelled while the prompt was tokenized")
        except TooManyTokens as exc:
            needed = exc.tokens + len(head) + len(tail)
            raise TooLarge(
                f"Requested tokens (at least {needed}) exceed context window of "
                f"{self.n_ctx}: shorten the prompt or raise model.n_ctx"
            ) from None
        ids += tail
        if len(ids) >= self.n_ctx:
            raise TooLarge(
                f"Requested tokens ({len(ids)}) exceed context window of {self.n_ctx}: "
                "shorten the prompt or raise model.n_ctx"
            )
        return ids

    # ------------------------------------------------------------------ sampling

    def _sampler(self, job: dict[str, Any]) -> Any:
        """The request's sampler chain: special-token mask, then llama-cpp-python's
        defaults (top_k 40, top_p, min_p 0.05, temperature, seeded draw), or greedy
        at temperature 0. A ``json_schema``'s grammar is not in it (``_grammar_sample``)."""
        params = llama_c.llama_sampler_chain_default_params()
        params.no_perf = True
        chain = llama_c.llama_sampler_chain_init(params)
        add = llama_c.llama_sampler_chain_add  # the chain owns what is added
        add(
            chain,
            llama_c.llama_sampler_init_logit_bias(
                llama_c.llama_vocab_n_tokens(self._vocab), len(self._mask), self._mask
            ),
        )
        temperature = float(job.get("temperature", DEFAULT_TEMPERATURE))
        if temperature <= 0:
            add(chain, llama_c.llama_sampler_init_greedy())
            return chain
        add(chain, llama_c.llama_sampler_init_top_k(TOP_K))
        add(chain, llama_c.llama_sampler_init_top_p(float(job.get("top_p", 0.95)), 1))
        add(chain, llama_c.llama_sampler_init_min_p(MIN_P, 1))
        add(chain, llama_c.llama_sampler_init_temp(temperature))
        add(chain, llama_c.llama_sampler_init_dist(int(job.get("seed", RANDOM_SEED))))
        return chain

    def grammar_sampler(self, schema: dict[str, Any]) -> Any:
        """A llama.cpp grammar sampler that admits only JSON valid for ``schema``.

        The schema and its grammar must stay within ``node.llama.grammar``'s bounds,
        and llama.cpp must parse the grammar (it returns NULL otherwise, which
        as a sampler crashes the worker at the first token: SIGSEGV).

        Raises:
            TooLarge: the schema or its grammar is beyond a bound (413).
            ProtocolError: the converter or llama.cpp cannot use the schema (400).
        """
        gbnf = schema_grammar(schema)
        with _LOG.at_level(LOG_QUIET), _LOG.capture() as lines:
            sampler = llama_c.llama_sampler_init_grammar(self._vocab, gbnf.encode(), b"root")
        if not sampler:
            # The parser's own message goes to fd 2 (the worker's log), not to the callback.
            why = " ".join(line.strip() for line in lines)[:200] or "no reason given"
            hint = (
                " A pattern's \\d, \\w or \\s is a common cause: write [0-9], [a-zA-Z0-9_] "
                "or [ \\t\\n] instead"
                if '"pattern"' in json.dumps(schema)
                else ""
            )
            raise ProtocolError(
                f"json_schema is not usable: llama.cpp cannot parse its grammar ({why}; "
                f"the worker's log has the details).{hint}"
            )
        return sampler


def _greedy(job: dict[str, Any]) -> bool:
    """Whether ``job`` samples with the greedy chain (``LlamaEngine._sampler``:
    temperature 0), which ``LlamaEngine._argmax`` can stand in for."""
    return float(job.get("temperature", DEFAULT_TEMPERATURE)) <= 0


def _put(batch: Any, i: int, token: int, pos: int, seq: int, logits: bool) -> None:
    """Row ``i`` of a ``llama_batch``: ``token`` at ``pos`` of sequence ``seq``."""
    batch.token[i] = token
    batch.pos[i] = pos
    batch.n_seq_id[i] = 1
    batch.seq_id[i][0] = seq
    batch.logits[i] = logits


#: Where a plain Q/A transcript's answer ends: the model starting the next turn.
QA_STOPS = ["\nQ:"]


def qa_prompt(messages: list[dict[str, str]]) -> str:
    """Render chat messages as a plain ``Q: ... / A: ...`` transcript.

    For base (not instruction-tuned) models without a chat template, such as
    the default Gemma 3 270M: a question/answer frame is the prompt shape they
    continue most reliably.
    """
    lines = []
    for m in messages:
        if m["role"] == "system":
            lines.append(m["content"] + "\n")
        elif m["role"] == "user":
            lines.append(f"Q: {m['content']}")
        else:
            lines.append(f"A: {m['content']}")
    lines.append("A:")
    return "\n".join(lines)


def _chat_formatter(llm: Any, chat_format: str) -> ChatFormatter | None:
    """How chat messages become a prompt: the llama-cpp-python format named
    ``chat_format`` (``_named_formatter``), else the GGUF's own
    ``tokenizer.chat_template`` (rendered as llama-cpp-python renders it, with
    ``Jinja2ChatFormatter``); None for a base model without one (a plain
    ``Q:/A:`` transcript: llama-cpp-python's fallback, the llama-2 format, is
    answered with nothing by such models).

    Raises:
        ValueError: ``chat_format`` names no prompt format.
    """
    if chat_format:
        return _named_formatter(chat_format)
    template = llm.metadata.get("tokenizer.chat_template", "")
    if not template:
        return None
    eos, bos = llm.token_eos(), llm.token_bos()
    return Jinja2ChatFormatter(
        template=template,
        eos_token=llm._model.token_get_text(eos) if eos != -1 else "",
        bos_token=llm._model.token_get_text(bos) if bos != -1 else "",
    )


def _named_formatter(name: str) -> ChatFormatter:
    """llama-cpp-python's prompt format registered as ``name`` ("gemma", "chatml",
    ...): the formatter function its chat handler wraps
    (``chat_formatter_to_chat_completion_handler`` keeps it in its closure).

    Raises:
        ValueError: no format has that name, or its handler is not a prompt
            format (function-calling handlers drive the model themselves).
    """
    try:
        registry = LlamaChatCompletionHandlerRegistry()  # type: ignore[no-untyped-call]
        handler = registry.get_chat_completion_handler_by_name(name)
    except LlamaChatCompletionHandlerNotFoundException:
        raise ValueError(f"model.chat_format {name!r} is not a llama-cpp-python format") from None
    closure = getattr(handler, "__closure__", None) or ()
    cells = [cell.cell_contents for cell in closure]
    formats = [c for c in cells if getattr(c, "__name__", "").startswith("format_")]
    if not formats:
        raise ValueError(f"model.chat_format {name!r} is not a prompt format this engine can use")
    formatter: ChatFormatter = formats[0]
    return formatter


@contextlib.contextmanager
def _model_params(use_extra_bufts: bool) -> Iterator[None]:
    """Load with ``use_extra_bufts`` set, which ``Llama()`` does not expose.

    Extra buffer types are llama.cpp's CPU weight repacking (AMX, AVX-512,
    ARM i8mm layouts): faster on some CPUs, but each process then holds a
    private copy of the weights instead of sharing the mmapped file, and on
    VMs that advertise AMX without enabling it the first matmul dies with
    SIGILL (seen on this project's CI machines).
    """
    original = llama_c.llama_model_default_params

    def patched() -> Any:
        params = original()
        params.use_extra_bufts = use_extra_bufts
        return params

    llama_c.llama_model_default_params = patched
    try:
        yield
    finally:
        llama_c.llama_model_default_params = original


@contextlib.contextmanager
def _context_params(n_seq_max: int) -> Iterator[None]:
    """Make ``Llama()``'s context with ``n_seq_max`` sequences and a KV cache split
    per sequence (``kv_unified = false``), which ``Llama()`` does not expose."""
    original = llama_c.llama_context_default_params

    def patched() -> Any:
        params = original()
        params.n_seq_max = n_seq_max
        params.kv_unified = False
        return params

    llama_c.llama_context_default_params = patched
    try:
        yield
    finally:
        llama_c.llama_context_default_params = original
