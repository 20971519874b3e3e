"""The engine seam: what a worker runs a request with.

The worker builds the configured engine (``node.worker.make_engine``). The
llama.cpp adapter lives in ``node.llama`` (the only package importing
``llama_cpp``); ``TestEngine`` here is a fast deterministic stand-in for broker
and process tests, never for the model's own end-to-end tests.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from broker.client_request import ClientRequest
from broker.errors import Cancelled, EdgeNodeError
from broker.token_count import TokenCount, TokenCounter

_log = logging.getLogger("edgenode.node")

#: Callback the engine calls once per generated piece of text (one token).
Emit = Callable[[str], None]
#: How one request ended: its FINAL fields (``text``, ``finish_reason``, ``usage``),
#: or the error it ended with.
Outcome = dict[str, Any] | EdgeNodeError


#: The engines ``workers.engine`` can name: llama.cpp, or the fast test stand-in.
ModelEngineName = Literal["llama", "test"]
#: The engines a worker can run: a model engine, or the rules (``rules-0``).
EngineName = Literal[ModelEngineName, "rules"]
#: What each kind loads before it can serve (the exit-66 wording: "<it> failed to load").
LOADS: dict[EngineName, str] = {"llama": "model", "test": "model", "rules": "rules"}


@dataclass(frozen=True)
class EngineSpec:
    """What a worker needs to build its engine (JSON-able, passed on its command line)."""

    kind: EngineName
    model_path: str
    n_ctx: int
    n_batch: int
    threads: int
    chat_format: str = ""
    repack: bool = False
    kv_type: str = "f16"  # model.kv_type: the K and V cache element type
    flash_attn: bool = True  # model.flash_attn (a quantized kv_type forces it on)
    slots: int = 1  # workers.slots: sequences served at once
    adaptive_threads: bool = True  # workers.adaptive_threads: 1 thread while starved
    test_token_ms: int = 20
    test_load_ms: int = 0


#: Most tokens of one slot's prompt in a step under flash attention: one less than
#: ggml-cpu's query tile (GGML_FA_TILE_Q = 64, ggml-cpu/common.h). At a tile or more
#: rows of one sequence, ``ggml_compute_forward_flash_attn_ext_f16`` takes its tiled
#: kernel, which rounds differently from the per-row one every decode step uses: a
#: prompt evaluated whole (tiled) and the same prompt's tail after prefix reuse
#: (per row) then gave different greedy answers. Below the tile every prompt row
#: goes through the per-row kernel; prompt evaluation measured ~4 % slower
#: (docs/bench/figures.md §node.llama.engine). The capacity plan's attention
#: scratch counts the rows a step can then carry (``node.capacity.plan``).
FLASH_PROMPT_ROWS = 63
#: Vocabulary tokens per ``llama_sampler_apply`` when a ``json_schema``'s grammar
#: filters them all (``node.llama.engine.LlamaEngine._grammar_filter``). Its CPU
#: budget is checked between pieces: 512 tokens took at most 0.45 s under the
#: costliest pattern measured (8192: 3.2 s), and the 512 calls per filter cost
#: nothing measurable (docs/bench/figures.md §node.llama.grammar). llama.cpp's
#: matching holds per-candidate vectors for the call's candidates only, so the
#: piece also bounds the grammar's memory peak (``node.capacity.plan.grammar_allowance``).
GRAMMAR_CHUNK = 512


def flash_attn_on(kv_type: str, wanted: bool) -> bool:
    """Whether the llama engine runs llama.cpp's flash attention: when
    ``model.flash_attn`` asks for it (the default, as llama-server's
    ``--flash-attn auto`` on CPU), and always for a quantized KV cache (a quantized
    V cache needs it: src/llama-context.cpp, ``llama_init_from_model`` refuses it
    otherwise, "quantized V cache requires flash_attn to be enabled").

    On by default: it decoded the default model 7-14 % faster on this machine's
    AVX2 cores (1 and 4 slots, f16 KV; docs/bench/figures.md §node.llama.engine)
    and plans a smaller attention scratch (``node.capacity.plan.attention_scratch``).
    ggml's CPU kernel (ggml-cpu/ops.cpp, ``ggml_compute_forward_flash_attn_ext_f16``)
    has three paths: per row (every decode step), tiled (64 or more rows of one
    sequence: long prompt chunks) and KV split across threads (one row of one
    sequence alone in a step, with 512 or more cells). The engine keeps every
    prompt chunk under the tile (``FLASH_PROMPT_ROWS``), so a
    prompt evaluated whole and its tail after prefix reuse round alike; a slot
    decoding alone with a long context still takes the split path, so a greedy
    answer there can differ near a tie from the same answer beside other slots.
    """
    return wanted or kv_type != "f16"


class Engine(Protocol):
    """A text generator for one sequence at a time.

    ``run`` blocks until the request is done and returns the final fields
    ``{"text", "finish_reason", "usage": {"prompt_tokens", "completion_tokens"}}``.
    It must check ``cancelled`` at least once per token and raise ``Cancelled``
    when it is set; other failures raise an ``EdgeNodeError`` subclass (e.g.
    ``TooLarge`` when the prompt does not fit the context).
    """

    kind: str
    model: str
    n_ctx: int
    #: Compute steps done so far (monotonic, any unit). It moves while the
    #: model evaluates a prompt, before any token exists, so the broker can tell
    #: a long prompt evaluation from a stalled worker.
    steps: int

    def run(self, job: dict[str, Any], cancelled: threading.Event, emit: Emit) -> dict[str, Any]:
        """Generate for ``job`` (a worker REQUEST body), calling ``emit`` per token."""
        ...


@runtime_checkable
class BatchEngine(Protocol):
    """An engine that runs up to ``slots`` requests together, stepped by one thread
    (``node.llama.engine.LlamaEngine``: continuous batching in one llama context).

    ``submit`` gives a request a slot (raising ``EdgeNodeError`` for a request
    refused before it starts); ``step`` advances every running request by one
    decode step or prompt chunk, and returns those that ended. A request whose
    ``cancelled`` is set leaves within one step. ``busy`` counts running requests.
    """

    kind: str
    model: str
    n_ctx: int
    steps: int
    slots: int
    #: The threads it computes with now (HEARTBEAT ``compute_threads``).
    compute_threads: int

    @property
    def busy(self) -> int:
        """Slots running a request."""
        ...

    def submit(self, rid: int, job: dict[str, Any], cancelled: threading.Event, emit: Emit) -> None:
        """Start ``job`` (a worker REQUEST body) in a free slot at the next step."""
        ...

    def step(self) -> list[tuple[int, Outcome]]:
        """One batch; the requests that ended in it, by rid."""
        ...


#: Bytes per token of the test engine's ``!long`` answer: a megabyte in 16 tokens.
LONG_TOKEN_BYTES = 64 * 1024


class TestEngine:
    """Deterministic engine: answers ``"echo: <prompt>"`` one word per ``token_ms``.

    ``test_load_ms`` delays construction, like a slow model load. Prompts
    starting with a directive drive fault tests of the worker process:
    ``!crash`` exits the process at once (exit 3); ``!hang`` blocks without
    progress and ignores cancellation; ``!slow <ms>`` sets the per-token delay
    for this request; ``!hog <MiB>`` allocates and touches that much memory
    (kept until the process ends), like a model outgrowing its cgroup;
    ``!json <object>`` answers with that JSON object (compact, four characters
    per token) instead of the echo, like a model held to a ``json_schema``;
    ``!prefill <ms>`` evaluates the prompt first at that many ms per prompt
    word, like llama.cpp's prompt evaluation whose time grows with the prompt
    (interruptible by a cancel, its steps counted as progress); ``!long <bytes>``
    answers that many bytes of ``x`` in tokens of ``LONG_TOKEN_BYTES``, like a
    long completion, for the reply-size limit (``broker.protocol.message_limits``).
    """

    __test__ = False  # not a pytest test class
    kind = "test"
    model = "test-engine"

    def __init__(self, spec: EngineSpec) -> None:
        time.sleep(spec.test_load_ms / 1000)
        self.n_ctx = spec.n_ctx
        self.token_s = spec.test_token_ms / 1000
        self.steps = 0
        self._hogged: list[bytearray] = []  # !hog's memory, a MiB per item

    def run(self, job: dict[str, Any], cancelled: threading.Event, emit: Emit) -> dict[str, Any]:
        """See ``Engine.run``."""
        prompt = job.get("prompt") or " ".join(m["content"] for m in job.get("messages", []))
        words = prompt.split()
        delay = self.token_s
        if words[:1] == ["!crash"]:
            os._exit(3)
        if words[:1] == ["!hang"]:
            threading.Event().wait()  # blocks forever, deaf to CANCEL
        if words[:1] == ["!slow"] and len(words) > 1 and words[1].isdigit():
            delay = int(words[1]) / 1000
        if words[:1] == ["!hog"] and len(words) > 1 and words[1].isdigit():
            # bytearray(n) memsets its n bytes (every page touched, charged) in one
            # C call that holds the GIL, long enough to miss heartbeats; a MiB per
            # call lets the I/O thread in between (docs/bench/figures.md §node.engine;
            # test_isolation.py::test_a_worker_lost_at_its_memory_limit_says_so).
            self._hogged.extend(bytearray(1 << 20) for _ in range(int(words[1])))
        if words[:1] == ["!prefill"] and len(words) > 1 and words[1].isdigit():
            self._prefill(len(words) * int(words[1]) / 1000, cancelled)
        if words[:1] == ["!json"]:
            obj, _ = json.JSONDecoder().raw_decode(prompt.split(None, 1)[1])
            answer = json.dumps(obj, separators=(",", ":"))
            tokens = [answer[i : i + 4] for i in range(0, len(answer), 4)]
        elif words[:1] == ["!long"] and len(words) > 1 and words[1].isdigit():
            size, step = int(words[1]), LONG_TOKEN_BYTES
            tokens = ["x" * min(step, size - i) for i in range(0, size, step)]
        else:
            tokens = ["echo:", *(" " + w for w in words)]
        pieces = tokens[: int(job.get("max_tokens", 16))]
        out: list[str] = []
        for token in pieces:
            if cancelled.wait(delay):
                raise Cancelled("cancelled", partial_text="".join(out))
            self.steps += 1
            out.append(token)
            emit(token)
        finish = "length" if len(pieces) < len(tokens) else "stop"
        usage = {"prompt_tokens": len(words), "completion_tokens": len(pieces)}
        return {"text": "".join(out), "finish_reason": finish, "usage": usage}

    def _prefill(self, seconds: float, cancelled: threading.Event) -> None:
        """Spend ``seconds`` before the first token, in steps of at most 10 ms."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            if cancelled.wait(min(0.01, left)):
                raise Cancelled("cancelled during prompt evaluation")
            self.steps += 1


class WordCounter:
    """The test engine's tokenizer: one token per whitespace-separated word (a
    ``broker.token_count.TokenCounter``; splitting is cheap, so its bounded count
    is the exact one)."""

    def __call__(self, req: ClientRequest) -> int:
        """The prompt's words."""
        text = req.prompt or " ".join(content for _, content in req.messages or ())
        return len(text.split())

    def bounded(self, req: ClientRequest, limit: int) -> TokenCount:
        """The exact count, whatever ``limit``."""
        return TokenCount(self(req), exact=True)


#: ``BackgroundCounter.state``.
CounterState = Literal["waiting", "loading", "loaded", "failed"]


class BackgroundCounter:
    """A ``broker.token_count.TokenCounter`` loaded on a thread of its own, so that
    the vocabulary's load (1-2 s of CPU for Gemma 3's 262,144 tokens,
    docs/bench/figures.md §node.llama.vocab) is not on the node's way to ready
    (``node.app`` starts it once the workers are ready: docs/bench/figures.md,
    "Start to ready").

    Until the load ends, ``bounded`` answers a lower bound of 0 (nothing learned:
    the worker decides and refuses an oversized prompt with 413 itself, as when a
    loaded counter's budget runs out); ``__call__`` waits for the load. A load
    that fails is logged and leaves sizes to the workers, as before.

    Args:
        load: makes the counter (e.g. ``make_token_counter``); run once, on the thread.
    """

    def __init__(self, load: Callable[[], TokenCounter]) -> None:
        self._load = load
        self._counter: TokenCounter | None = None
        self._done = threading.Event()
        # A daemon: a node stopped during the load need not wait for it.
        self._thread = threading.Thread(target=self._run, name="token-counter", daemon=True)
        #: Whether ``start`` was called.
        self.started = False

    def start(self) -> None:
        """Begin the load; later calls do nothing."""
        if not self.started:
            self.started = True
            self._thread.start()

    @property
    def state(self) -> CounterState:
        """``waiting`` (not started), ``loading``, ``loaded`` or ``failed`` (sizes are
        then checked by the workers only); ``edgenode status`` shows it."""
        if not self.started:
            return "waiting"
        if not self._done.is_set():
            return "loading"
        return "loaded" if self._counter is not None else "failed"

    def _run(self) -> None:
        started = time.monotonic()
        try:
            self._counter = self._load()
        except Exception as exc:  # a model llama.cpp cannot read: workers will say why
            _log.warning("no token counter (%s); prompt sizes are checked by workers only", exc)
        else:
            _log.info("token counter loaded in %.2f s", time.monotonic() - started)
        finally:
            self._done.set()

    def __call__(self, req: ClientRequest) -> int:
        """The exact count, once loaded (waits for the load).

        Raises:
            RuntimeError: the load failed.
        """
        self._done.wait()
        if self._counter is None:
            raise RuntimeError("the token counter could not be loaded")
        return self._counter(req)

    def bounded(self, req: ClientRequest, limit: int) -> TokenCount:
        """The loaded counter's answer; before that, a lower bound of 0 tokens."""
        counter = self._counter
        if counter is None:
            return TokenCount(0, exact=False)
        return counter.bounded(req, limit)


def make_token_counter(spec: EngineSpec) -> TokenCounter:
    """The prompt-token counter matching ``spec``'s engine (for the broker's 413 check)."""
    if spec.kind == "test":
        return WordCounter()
    from node.llama.vocab import make_token_counter as llama_counter

    return llama_counter(spec.model_path)


def load_error_line(exc: Exception) -> str:
    """One line saying why ``node.worker.make_engine`` failed, for the worker's status.

    A bad rules file gives its first error, e.g. ``/run/rules.toml: not valid TOML:
    ... (+2 more)``; anything else the first line of its message.
    """
    from fallback.rules import RulesError

    if isinstance(exc, RulesError):
        return exc.summary
    text = exc.message if isinstance(exc, EdgeNodeError) else str(exc)
    lines = text.strip().splitlines()
    return lines[0] if lines else type(exc).__name__
