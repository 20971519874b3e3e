"""Capacity model: how many sequences fit in the memory budget, before anything starts.

``total = weights + W x (S x KV per sequence + runtime + grammar)`` (bytes) for W
workers of S slots each (W x S sequences), from the GGUF metadata (read without
loading the weights) and the budget:

* KV per sequence = ``kv_bytes_per_token x pad256(n_ctx)``; ``kv_bytes_per_token``
  = sum over layers of ``n_head_kv x (key_length x bytes_K + value_length x
  bytes_V)`` (llama.cpp src/llama-kv-cache.cpp; key/value length default to
  embedding_length / head_count). Bytes per element are ggml's ``type_size /
  block_size`` (gguf ``GGML_QUANT_SIZES``): f16 2, q8_0 34/32, q4_0 18/32.
  llama.cpp pads the context, ``GGML_PAD(n_ctx, 256)`` (src/llama-context.cpp).
  Sliding-window layers count in full: llama-cpp-python keeps llama.cpp's default
  ``swa_full`` (logged "using full-size SWA cache"; the ``llama_kv_cache: size``
  lines of the default model match this formula exactly).
* Weights = the GGUF tensor bytes: one shared page cache when mmapped and not
  repacked (``model.repack = false``), counted once; a private copy per worker
  when repacked (see ``node.llama.engine``), counted per worker.
* Runtime per worker = ``capacity.runtime_overhead`` (interpreter, libraries,
  llama.cpp's fixed buffers; measured by ``scripts/bench_memory.py``) plus the
  attention scratch that grows with the context: without flash attention
  llama.cpp materialises f32 ``KQ`` and ``softmax(KQ)``, ``n_ctx x n_ubatch x
  n_head`` each (fits the default model's measured private memory within 6 %
  from n_ctx 256 to 8192). A quantized ``kv_type`` needs flash attention
  (``node.engine.flash_attn_on``), which never materialises ``KQ``: see
  ``attention_scratch``.
* Grammar per worker = ``grammar_allowance``: a request with a ``json_schema``
  is sampled through a llama.cpp grammar, which checks vocabulary tokens against
  it: llama.cpp holds per-candidate vectors for the tokens of one call, and the
  engine filters ``node.engine.GRAMMAR_CHUNK`` tokens per call
  (``LlamaEngine._grammar_filter``): ``GRAMMAR_CHUNK x GRAMMAR_BYTES_PER_TOKEN``
  once per worker (its slots are sampled one after another in one thread), plus
  ``GRAMMAR_STATE_BYTES`` per slot for each grammar's rules and parse stacks.
  Planned for every worker, since any request may carry a schema. Before the
  filter worked in pieces it was ``n_vocab x GRAMMAR_BYTES_PER_TOKEN``: 176 MiB
  for the default model.
* Slots (``workers.slots``): a worker with S slots is one process, one model,
  one llama context of S sequences with ``model.n_ctx`` cells each (non-unified
  KV), so it pays S x KV per sequence and the runtime and grammar once.
  ``resolve_slots`` turns the setting into an int ("auto": ``AUTO_SLOTS_PER_THREAD``
  per thread a worker really runs).

Sizes are binary (``G`` = GiB = 2**30, ``M`` = MiB; ``node.units``), as systemd's
``MemoryMax=`` reads them. That makes the textbook example exact: 8G - 4.2G
weights - 1.5G reserve = 2.3 GiB left; 2.3 GiB / 256 MiB = 9.2, so 9 sequences
(in SI units, 2.3 GB / 256 MB = 8.98 would give 8).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from broker.errors import ConfigError
from node.capacity.budget import config_size, configured_budget, node_limit
from node.capacity.gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ModelMeta, read_gguf_meta
from node.capacity.worker_limits import is_auto, memory_high_bytes, memory_max_bytes
from node.config import MAX_SLOTS, is_auto_slots
from node.engine import FLASH_PROMPT_ROWS, GRAMMAR_CHUNK, flash_attn_on
from node.model import resolve_model
from node.sandbox.cores import worker_threads
from node.units import format_size as _format_size

if TYPE_CHECKING:
    from node.config import NodeConfig

CTX_PAD = 256  # llama.cpp: GGML_PAD(n_ctx, 256)
N_UBATCH = 512  # llama-cpp-python's default n_ubatch
PAGE = 4096
#: Bytes per candidate token that llama.cpp's grammar matching holds during one
#: ``llama_sampler_apply`` (``grammar_allowance``): measured with the whole
#: vocabulary in one call, the most ``scripts/bench_grammar.py`` saw over every
#: schema case ``node.llama.grammar`` admits, rounded up (docs/bench/figures.md
#: §node.capacity.plan). It follows the candidates (llama-grammar.cpp,
#: ``llama_grammar_reject_candidates_for_stack``: 32 B per candidate and per code
#: point matched), while the schema's size or depth hardly matters.
GRAMMAR_BYTES_PER_TOKEN = 704
#: Bytes of one request's grammar itself (its rules and parse stacks, within
#: ``node.llama.grammar``'s bounds), per slot: the largest schemas allowed raised a
#: worker's peak RSS by 0.3-0.6 MiB over a plain request and its cgroup peak by
#: 0.1-1.7 MiB (four slots), rounded up (docs/bench/figures.md §node.capacity.plan).
GRAMMAR_STATE_BYTES = 2 * 2**20
#: Bytes per vocabulary token that each slot beyond the first adds to a worker:
#: its row of f32 logits (4 B, llama.cpp's output buffer holds one per sequence)
#: and its sampler's candidate array (``llama_token_data``, 12 B); checked against
#: ``scripts/bench_memory.py`` (docs/bench/figures.md §node.capacity.plan).
SLOT_BYTES_PER_TOKEN = 16
KV_TYPES = {
    "f16": GGMLQuantizationType.F16,
    "q8_0": GGMLQuantizationType.Q8_0,
    "q4_0": GGMLQuantizationType.Q4_0,
}
#: ``workers.slots = "auto"`` gives a worker at most this many slots per thread it
#: really runs (``node.sandbox.cores.worker_threads``: ``workers.threads`` cut to its
#: cores and quota): beyond 4 per core, requests wait much longer for little more
#: aggregate throughput (measured: docs/bench/figures.md §node.capacity.plan).
AUTO_SLOTS_PER_THREAD = 4


def format_size(n: int) -> str:
    """``node.units.format_size`` that also shows a deficit: ``-235.2 MiB``."""
    return "-" + _format_size(-n) if n < 0 else _format_size(n)


def bytes_per_element(kv_type: str) -> Fraction:
    """ggml's ``type_size / block_size`` of a KV cache type: f16 2, q8_0 34/32, q4_0 18/32.

    Raises:
        ConfigError: not one of ``KV_TYPES``.
    """
    if kv_type not in KV_TYPES:
        raise ConfigError(f"kv type must be one of {', '.join(KV_TYPES)}; got {kv_type!r}")
    block, size = GGML_QUANT_SIZES[KV_TYPES[kv_type]]
    return Fraction(size, block)


def kv_bytes_per_token(meta: ModelMeta, type_k: str = "f16", type_v: str | None = None) -> int:
    """Bytes of K and V cache per context cell, all layers (rounded up)."""
    b_k, b_v = bytes_per_element(type_k), bytes_per_element(type_v or type_k)
    per_head = meta.key_length * b_k + meta.value_length * b_v
    return math.ceil(sum(h * per_head for h in meta.n_head_kv))


def kv_cells(n_ctx: int) -> int:
    """Context cells llama.cpp allocates for ``n_ctx``: rounded up to a multiple of 256."""
    return -(-n_ctx // CTX_PAD) * CTX_PAD


def attention_scratch(
    meta: ModelMeta, n_ctx: int, n_batch: int, flash_attn: bool = False, slots: int = 1
) -> int:
    """Bytes of llama.cpp's attention scratch that grow with the context, for the
    most rows a step evaluates: n_ubatch = min(n_ctx, n_batch, 512) as
    llama-cpp-python sets it, and under flash attention at most ``slots x
    FLASH_PROMPT_ROWS`` (the engine's cap on each slot's prompt chunk; a step's
    decode rows fit in it: ``node.engine.FLASH_PROMPT_ROWS``).

    Without flash attention: f32 ``KQ`` + ``softmax(KQ)``, ``2 x 4 x n_head x
    n_ubatch x cells`` (src/llama-graph.cpp, ``build_attn_mha``). With it
    (``ggml_flash_attn_ext``, no ``KQ``): ``4 x rows x (cells + 4 x n_head x
    key_length)``, fitted on the default model's private memory after a full
    prompt in 512-row chunks (docs/bench/figures.md §node.capacity.plan); read it
    as the f16 ``KQ`` masks of Gemma 3's two KV caches plus four f32 Q-sized
    tensors, all one row per token of the step. llama.cpp reserves the buffer for
    n_ubatch rows; the pages of rows a step never carries stay untouched.
    """
    ubatch = min(n_ctx, n_batch, N_UBATCH)
    if flash_attn:
        rows = min(ubatch, slots * FLASH_PROMPT_ROWS)
        return 4 * rows * (kv_cells(n_ctx) + 4 * meta.n_head * meta.key_length)
    return 2 * 4 * meta.n_head * ubatch * kv_cells(n_ctx)


@dataclass(frozen=True)
class Plan:
    """A memory plan for ``workers`` workers of ``slots`` sequences each (sizes in bytes).

    ``per_worker = private weights + slots x kv_per_seq + runtime_per_worker +
    grammar``: the runtime and the grammar allowance once per worker (its slots
    are sampled one after another in one thread, so one filter's peak at a
    time), the KV cache once per slot. ``sequences = workers x slots``. ``left =
    budget - reserve - shared weights``: ``left // per_worker`` workers fit before
    the margin. With it each worker is budgeted at its hard limit ``memory_max =
    per_worker x (1 + margin)``, so ``fits_safe = left // memory_max`` workers
    (of ``slots`` slots each) and the limits together never reach into the reserve.
    ``memory_high = per_worker x (1 + margin / 2)`` is the soft line (v2 reclaims
    and throttles above it; on v1 the node watches usage against it). Limits
    cover private memory only: the shared weights must be charged to the node's
    cgroup (faulted in before workers start), as page cache is charged to the
    cgroup that first touches it.
    """

    budget: int
    reserve: int
    weights: int
    kv_per_seq: int
    workers: int
    slots: int = 1  # sequences per worker (workers.slots, resolved)
    margin: float = 0.1
    runtime_overhead: int = 0  # per worker, constant part
    weights_shared: bool = True
    budget_source: str = "given"
    #: The cgroup file whose limit bounds ``budget`` ("" when none does): a larger
    #: ``capacity.memory_budget`` would only be cut to it again.
    budget_cap: str = ""
    model: str = ""
    n_ctx: int = 0  # 0 = sizes given by hand, no model read
    n_batch: int = 0
    kv_type: str = ""
    flash_attn: bool = False  # workers run flash attention (node.engine.flash_attn_on)
    kv_per_token: int = 0
    scratch: int = 0  # per worker, grows with n_ctx
    n_vocab: int = 0
    grammar: int = 0  # per worker: the peak a json_schema request adds (grammar_allowance)
    slot_runtime: int = 0  # per slot beyond the first: its logits row and candidates

    def __post_init__(self) -> None:
        if min(self.budget, self.weights, self.kv_per_seq, self.reserve, self.workers) < 0:
            raise ConfigError("sizes and the worker count must not be negative")
        if not 1 <= self.slots <= MAX_SLOTS:
            raise ConfigError(f"workers.slots must be in [1, {MAX_SLOTS}]; got {self.slots}")
        if not 0 <= self.margin < 1:
            raise ConfigError(f"capacity.safety_margin must be in [0, 1); got {self.margin}")
        if self.per_worker <= 0:
            raise ConfigError("the per-sequence size must be positive (--kv-per-seq)")

    @property
    def runtime_per_worker(self) -> int:
        """Everything private to a worker except its KV (and weights copy): the
        runtime measured with one slot, plus ``slot_runtime`` per further slot."""
        return self.runtime_overhead + self.scratch + (self.slots - 1) * self.slot_runtime

    @property
    def shared_weights(self) -> int:
        """Weights counted once (mmapped page cache), or 0 when each worker has a copy."""
        return self.weights if self.weights_shared else 0

    @property
    def kv_per_worker(self) -> int:
        """KV cache of one worker: ``slots x kv_per_seq`` (each slot has its own cells)."""
        return self.slots * self.kv_per_seq

    @property
    def per_worker(self) -> int:
        """Private memory of one worker at its peak: its slots' KV, runtime and one grammar."""
        private = 0 if self.weights_shared else self.weights
        return private + self.kv_per_worker + self.runtime_per_worker + self.grammar

    @property
    def sequences(self) -> int:
        """Sequences the asked workers run at once: ``workers x slots``."""
        return self.workers * self.slots

    @property
    def left(self) -> int:
        """What the workers may use: budget - reserve - shared weights."""
        return self.budget - self.reserve - self.shared_weights

    @property
    def total(self) -> int:
        """Estimate of the model side: shared weights + workers x per_worker."""
        return self.shared_weights + self.workers * self.per_worker

    @property
    def memory_max(self) -> int:
        """Per-worker cgroup ``memory.max``, page-rounded."""
        return _page_up(self.per_worker * (1 + self.margin))

    @property
    def memory_high(self) -> int:
        """Per-worker cgroup ``memory.high``, page-rounded."""
        return _page_up(self.per_worker * (1 + self.margin / 2))

    @property
    def fits_before_margin(self) -> int:
        """Workers (of ``slots`` slots each) that fit on the bare estimates."""
        return max(0, self.left // self.per_worker)

    @property
    def fits_safe(self) -> int:
        """Workers (of ``slots`` slots each) that fit with every one at its ``memory_max``."""
        return max(0, self.left // self.memory_max)

    @property
    def fits(self) -> bool:
        """Whether the asked workers fit with the margin."""
        return self.workers <= self.fits_safe

    def as_dict(self) -> dict[str, Any]:
        """Fields and derived values (``--json``, ``status``)."""
        return dataclasses.asdict(self) | {k: getattr(self, k) for k in _DERIVED_KEYS}


_DERIVED = "runtime_per_worker shared_weights kv_per_worker per_worker sequences left total"
_DERIVED += " memory_max memory_high"
_DERIVED += " fits_before_margin fits_safe fits"
_DERIVED_KEYS = _DERIVED.split()


def _page_up(n: float) -> int:
    return math.ceil(n / PAGE) * PAGE


def grammar_allowance(n_vocab: int, slots: int = 1) -> int:
    """Bytes a worker of ``slots`` slots grows by while it samples under ``json_schema``
    grammars, for a model of ``n_vocab`` tokens (0 without a vocabulary):
    ``min(n_vocab, GRAMMAR_CHUNK) x GRAMMAR_BYTES_PER_TOKEN`` for the candidates of
    one filter call, once, plus ``slots x GRAMMAR_STATE_BYTES`` (2.3 MiB for one slot
    of the default model, 8.3 MiB for four; measured by ``scripts/bench_grammar.py``)."""
    if n_vocab <= 0:
        return 0
    return min(n_vocab, GRAMMAR_CHUNK) * GRAMMAR_BYTES_PER_TOKEN + slots * GRAMMAR_STATE_BYTES


def model_plan(meta: ModelMeta, **ask: Any) -> Plan:
    """The plan for ``meta``: ``ask`` holds ``Plan`` fields (budget, reserve, workers,
    margin, ..., n_ctx, n_batch, kv_type, flash_attn: asked, forced on by a
    quantized kv_type); the model's sizes are derived."""
    per_token = kv_bytes_per_token(meta, ask["kv_type"])
    flash = flash_attn_on(ask["kv_type"], ask.pop("flash_attn", False))
    return Plan(
        weights=meta.weights_bytes,
        kv_per_seq=per_token * kv_cells(ask["n_ctx"]),
        model=meta.name,
        kv_per_token=per_token,
        scratch=attention_scratch(meta, ask["n_ctx"], ask["n_batch"], flash, ask.get("slots", 1)),
        flash_attn=flash,
        n_vocab=meta.n_vocab,
        grammar=grammar_allowance(meta.n_vocab, ask.get("slots", 1)),
        slot_runtime=meta.n_vocab * SLOT_BYTES_PER_TOKEN,
        **ask,
    )


def config_plan(config: NodeConfig, **overrides: Any) -> tuple[Plan, ModelMeta | None]:
    """The plan for ``config`` and the model's metadata (None for the test engine:
    no model, only its runtime overhead is planned). ``overrides`` that are not
    None replace ``Plan`` inputs (``budget``, ``reserve``, ``workers``, ``n_ctx``,
    ``kv_type``; sizes in bytes) and ``slots`` (an int or "auto"). The plan's
    ``slots`` is the resolved count (``resolve_slots``).

    Raises:
        ConfigError: a bad capacity key (named), or the model cannot be read.
    """
    cap, m = config.capacity, config.model
    given = {k: v for k, v in overrides.items() if v is not None}
    slots: int | str = given.pop("slots", config.workers.slots)
    if "budget" not in given:
        given["budget"], given["budget_source"] = configured_budget(config)
        bound = node_limit(config)
        if bound is not None and given["budget"] >= bound.bytes:
            given["budget_cap"] = bound.source
    ask: dict[str, Any] = {
        "reserve": config_size(cap.reserve, "capacity.reserve"),
        "workers": config.workers.count,
        "margin": cap.safety_margin,
        "runtime_overhead": config_size(cap.runtime_overhead, "capacity.runtime_overhead"),
        "weights_shared": not m.repack,
    } | given
    threads = worker_threads(config.workers, ask["workers"])
    if config.workers.engine != "llama":

        def test(s: int) -> Plan:
            return Plan(weights=0, kv_per_seq=0, model="test engine", slots=s, **ask)

        return plan_slots(test, slots, threads), None
    model = {"n_ctx": m.n_ctx, "n_batch": m.n_batch, "kv_type": m.kv_type}
    ask = model | {"flash_attn": m.flash_attn} | ask
    meta = read_gguf_meta(resolve_model(m.path))
    # "auto" also keeps a worker within a fixed workers.memory_max (check_fits refuses more).
    limit = None if is_auto(config.workers) else memory_max_bytes(config.workers)
    return plan_slots(lambda s: model_plan(meta, slots=s, **ask), slots, threads, limit), meta


def resolve_slots(config: NodeConfig, **overrides: Any) -> int:
    """``workers.slots`` as an int: the integer as configured (no model read), or
    for "auto" the largest S for which ``workers.count`` workers of S slots fit the
    capacity plan with its margin (and, with the llama engine, one worker's
    estimate fits a fixed ``workers.memory_max``), at most
    ``AUTO_SLOTS_PER_THREAD x`` the threads a worker really runs
    (``node.sandbox.cores.worker_threads``) and ``MAX_SLOTS``, at least 1
    (a plan that does not fit even then is refused by ``check_fits``).
    ``overrides`` as for ``config_plan`` (``workers``, ``budget``, ..., ``slots``).

    ``edgenode start``, ``edgenode capacity``, ``status`` and the worker pool all
    take the slots from here, or from the plan ``config_plan``/``check_fits``
    returns, whose ``slots`` is this same number.

    Raises:
        ConfigError: "auto" with a bad capacity key, an unreadable model or an
            impossible core reservation.
    """
    slots = overrides.get("slots")
    slots = config.workers.slots if slots is None else slots
    if not is_auto_slots(slots):
        return int(slots)
    return config_plan(config, **overrides)[0].slots


def auto_slots(plan_for: Callable[[int], Plan], most: int, limit: int | None = None) -> Plan:
    """The plan with the most slots in [1, ``most``] that fits (``Plan.fits``, and a
    worker's estimate within ``limit`` bytes when one is given: a fixed
    ``workers.memory_max``), else the 1-slot plan; ``plan_for(S)`` is the plan with S
    slots per worker. A worker's size grows with S, so the search stops at the first
    S that fails."""
    best = plan_for(1)
    for s in range(2, most + 1):
        plan = plan_for(s)
        if not plan.fits or (limit is not None and plan.per_worker > limit):
            break
        best = plan
    return best


def plan_slots(
    plan_for: Callable[[int], Plan], slots: int | str, threads: int, limit: int | None = None
) -> Plan:
    """The plan for ``slots`` per worker: ``plan_for(slots)`` for an integer; for
    "auto" ``auto_slots`` up to ``AUTO_SLOTS_PER_THREAD x threads`` (the threads
    each worker runs, ``node.sandbox.cores.worker_threads``; and
    ``MAX_SLOTS``) within ``limit`` (see there). ``config_plan`` and the CLI's sizes
    by hand both use it."""
    if is_auto_slots(slots):
        most = max(1, min(MAX_SLOTS, AUTO_SLOTS_PER_THREAD * threads))
        return auto_slots(plan_for, most, limit)
    return plan_for(int(slots))


def check_fits(config: NodeConfig) -> Plan:
    """The plan for ``config``, or a refusal; ``edgenode start`` calls it first, and the
    node takes the workers' limits from the plan it returns (``workers.memory_max =
    "auto"``: ``node.capacity.worker_limits``).

    Raises:
        ConfigError: the configured workers do not fit the budget with the margin
            (the message says what was asked, what fits and which knob to turn),
            a worker's ``memory_max`` is below what one worker needs, a
            ``memory_high`` is above the plan's ``memory.max`` ("auto"), or a
            capacity key is invalid.
    """
    plan, meta = config_plan(config)
    if not plan.fits:
        raise ConfigError(refusal(plan, meta))
    limit = memory_max_bytes(config.workers, plan)
    if config.workers.engine == "llama" and limit is not None and limit < plan.per_worker:
        raise ConfigError(
            f"capacity: workers.memory_max {format_size(limit)} is below the "
            f"{format_size(plan.per_worker)} one worker needs ({breakdown(plan)}): every worker "
            f"would be OOM-killed. Set workers.memory_max to {format_size(plan.memory_max)} or "
            f'more (or "auto"), or lower model.n_ctx{_fewer_slots(plan)}.'
        )
    high = memory_high_bytes(config.workers, plan)
    if limit is not None and high is not None and high > limit:  # only "auto" gets here
        raise ConfigError(
            f"capacity: workers.memory_high {format_size(high)} is above the "
            f'{format_size(limit)} the plan gives workers.memory_max = "auto". Leave '
            'workers.memory_high "" (the plan\'s memory.high) or lower it.'
        )
    return plan


def _fewer_slots(plan: Plan) -> str:
    return f" or workers.slots (now {plan.slots})" if plan.slots > 1 else ""


def layout(plan: Plan) -> str:
    """``2 worker(s) x 4 slots = 8 sequences`` (``1 slot`` when one)."""
    slots = "1 slot" if plan.slots == 1 else f"{plan.slots} slots"
    return f"{plan.workers} worker(s) x {slots} = {plan.sequences} sequences"


def refusal(plan: Plan, meta: ModelMeta | None) -> str:
    """Why ``plan`` does not fit, and the knobs that would make it fit."""
    each = "" if plan.slots == 1 else f" of {plan.slots} slots"
    return (
        f"capacity: {plan.workers} worker(s){each} do not fit."
        f" Each needs {format_size(plan.per_worker)}"
        f" ({breakdown(plan)}), {format_size(plan.memory_max)} with the {plan.margin:.0%} margin;"
        f" {format_size(plan.left)} is left of the {format_size(plan.budget)} budget"
        f" ({plan.budget_source}) after the {format_size(plan.reserve)} reserve and"
        f" {format_size(plan.shared_weights)} of shared weights, so {plan.fits_safe} fit."
        " Turn a knob: " + "; or ".join(advice(plan, meta)) + "."
    )


def breakdown(plan: Plan) -> str:
    """One worker's estimate: ``KV 4 x 36 MiB + runtime 132 MiB + grammar 8.3 MiB``
    (slots x KV per sequence; + private weights; no grammar term without a model)."""
    parts = [] if plan.weights_shared else [f"weights {format_size(plan.weights)}"]
    parts += [
        f"KV {plan.slots} x {format_size(plan.kv_per_seq)}",
        f"runtime {format_size(plan.runtime_per_worker)}",
    ]
    parts += [f"grammar {format_size(plan.grammar)}"] if plan.grammar else []
    return " + ".join(parts)


def advice(plan: Plan, meta: ModelMeta | None) -> list[str]:
    """Knob settings that would make ``plan.workers`` fit, most direct first:
    fewer workers, fewer slots per worker, a shorter context, a smaller KV type,
    shared weights, a larger budget."""
    tips = [f"workers.count = {plan.fits_safe} (--workers)"] if plan.fits_safe else []
    fewer = range(plan.slots - 1, 0, -1)
    slots = next((s for s in fewer if dataclasses.replace(plan, slots=s).fits), None)
    if slots:
        tips.append(f"workers.slots = {slots} (--slots; fewer sequences per worker)")
    if meta is not None:
        ctx = largest_fitting_ctx(plan, meta)
        if ctx:
            tips.append(f"model.n_ctx = {ctx} (--n-ctx)")
        smaller = [k for k in KV_TYPES if bytes_per_element(k) < bytes_per_element(plan.kv_type)]
        kv = next((k for k in smaller if _replan(plan, meta, kv_type=k).fits), None)
        if kv:
            tips.append(f'model.kv_type = "{kv}" (--kv-type; workers then use flash attention)')
        if not plan.weights_shared and _replan(plan, meta, weights_shared=True).fits:
            tips.append("model.repack = false (one shared copy of the weights)")
    need = -(-(plan.reserve + plan.shared_weights + plan.workers * plan.memory_max) // (1 << 20))
    if plan.budget_cap:  # a larger memory_budget would be cut to this limit again
        tips.append(
            f"a memory limit of {need}M or more in {plan.budget_cap} (the node's cgroup path;"
            " capacity.memory_budget cannot exceed it), or a smaller capacity.reserve (--reserve)"
        )
    else:
        tips.append(
            f'capacity.memory_budget = "{need}M" or more (--memory), or a smaller'
            " capacity.reserve (--reserve)"
        )
    return tips


def largest_fitting_ctx(plan: Plan, meta: ModelMeta) -> int | None:
    """The largest context (tokens, a multiple of ``CTX_PAD``) below ``plan.n_ctx``'s
    padded cells with which ``plan`` fits, or None if not even ``CTX_PAD`` does.

    A bisection over the multiples of ``CTX_PAD``: a plan only grows with n_ctx (KV
    cells and attention scratch both do), so "fits" holds up to one context and
    fails above it. At most ~23 plans for n_ctx up to 2**31-1, where stepping down
    256 tokens at a time took minutes.
    """
    low, high = 0, kv_cells(plan.n_ctx) // CTX_PAD - 1  # in units of CTX_PAD
    # Invariant: ``low`` fits (0 stands for "none"), everything above ``high`` fails.
    while low < high:
        mid = (low + high + 1) // 2
        if _replan(plan, meta, n_ctx=mid * CTX_PAD).fits:
            low = mid
        else:
            high = mid - 1
    return low * CTX_PAD or None


_ASK = (
    "budget reserve workers margin runtime_overhead weights_shared budget_source budget_cap n_ctx"
)
_ASK_KEYS = [*_ASK.split(), "n_batch", "kv_type", "flash_attn", "slots"]


def _replan(plan: Plan, meta: ModelMeta, **changes: Any) -> Plan:
    return model_plan(meta, **({k: getattr(plan, k) for k in _ASK_KEYS} | changes))
