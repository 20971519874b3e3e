"""Scenario ``throughput``: aggregate tokens/s and time to first token of the node at 1, 2,
4 and 8 concurrent requests, against llama-cpp-python alone and, when given, llama-server
(README, "Benchmark"; ``scripts/bench_throughput.py`` runs the same measurement with
more options: layouts, rounds, pinning, repacking).

What it measures, in one run, on the same cores (``--cpus``), with the default model
(``node.model.resolve_model("default")``), the same prompts (six story and
instruction prompts of 26-39 tokens, cycled), greedy sampling (temperature 0, sent
explicitly to every backend) and at most 128 generated tokens per request, at 1, 2,
4 and 8 concurrent requests (``--levels``):

* **aggregate tokens/s**: the tokens actually generated (as each backend counts
  them: the node's ``usage.completion_tokens``, llama-server's
  ``timings.predicted_n``, for llama-cpp-python the tokens its ``generate`` yields
  less a final end-of-generation token) by a batch of N closed-loop clients, each
  sending its requests one after another, divided by the batch's wall time (the
  first request sent to the last reply);
* **TTFT p50 / p99**: from sending a request to its first streamed text, over every
  request of the batch, by nearest rank (``node.bench.stats.percentiles``). With 6-16
  requests per level p99 is the slowest request's TTFT.

Prompt caching is left at each backend's default (the node and llama-server reuse
a slot's KV for a shared prefix, llama-cpp-python its last prompt's): the prompts
differ from their first word on, so only a request landing on a slot that last
served the same prompt reuses more than the BOS token; the JSON counts those
(``reused_prompts``, from the node's ``cached_tokens`` and llama-server's
``cache_n``). The warm-up uses a prompt of its own.

The backends:

* ``node WxS``: edgenode (``edgenode start --foreground`` in a private run dir,
  ``node.testing.NodeProcess``) with W llama workers of S slots each
  (``--layout WxS``, repeatable), ``workers.threads = --threads`` (the node caps it
  at each worker's share of the cores: 2 workers on 2 cores get 1 thread each;
  the report shows what the workers got), ``routing.mode = "full"`` and no rules, so
  every answer is the model's; requests stream through ``broker.client``.
* ``direct``: llama-cpp-python's ``Llama(model, n_ctx=2048, n_threads=T,
  n_threads_batch=T, flash_attn=F)`` in a subprocess serving one request at a time
  (``create_completion(stream=True)``): its high-level API cannot batch, so N
  concurrent requests queue and their TTFT includes the wait, as behind
  llama-cpp-python's server lock. ``direct -nr`` is the same without weight
  repacking (``use_extra_bufts = false``, as the node's default ``model.repack =
  false``); llama-cpp-python's default repacks.
* ``llama-server``: llama.cpp's server built from the llama.cpp that
  llama-cpp-python vendors, ``llama-server -m MODEL -t T -tb T --parallel N -c
  N*2048``, restarted for every level N, streaming ``/completion`` with
  ``n_predict`` 128. ``llama-server -nr`` adds ``--no-repack`` (llama-server
  repacks by default; the node does not). ``--repack on|off|both`` picks the
  variants of both baselines (default both).

``--flash-attn on|off`` sets flash attention alike in every backend (the node's
``model.flash_attn``, ``Llama(flash_attn=)``, ``llama-server -fa``), so ratios
compare like with like; the default leaves each backend at its own default (the
node on, llama-cpp-python off, llama-server ``auto``, which is on for CPU).

Every process is pinned to ``--cpus`` (default: the cores the node's default
``workers.cpus = "auto"`` gives its workers, ``backends.default_cores``: every allowed
core but the first): the baselines with ``taskset``, the node by starting it from a
thread pinned there, with ``workers.cpus = []`` (its processes inherit the affinity,
and the node places its workers within it);
the report records each process's affinity as measured after start. Everything
runs at ``--nice`` (default 0, for the node ``workers.nice``): the node's default
nice 10 would let outside load fall on the node alone. Every backend is started,
warmed up (8 tokens for every client and every node slot at once: a worker's
first request pages the weights in), measured and stopped for each level of each
round. Rounds are interleaved (round r: every level, every backend; the script's
backends run in reverse order in odd rounds, ABC CBA), and the
report takes per level the median over rounds of each number and of each same-round
ratio, so outside load falls on each backend alike. Outside load is measured too
(CPU time on ``--cpus`` spent by neither this process nor the backend, in cores): a
level is measured again, up to ``--retries`` times, when it exceeds
``--max-outside-load``. It matters: llama.cpp's threads wait for each other at every
step, so a 2-thread process on 2 cores beside one busy core can slow down 10-50x.

In ``edgenode bench`` (``run``): the node with its built-in worker layout, ``direct -nr``
(llama-cpp-python without weight repacking, as the node's default ``model.repack``) and,
with ``--llama-server``, ``llama-server -nr``; one round on the default's cores, at 1, 2,
4 and 8 concurrent (quick: 1 and 4, a third of the requests, 32 tokens each).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from node.bench.backends import (
    Backend,
    DirectBackend,
    NodeBackend,
    Outcome,
    ServerBackend,
    affinities,
    cpu_list,
    default_cores,
)
from node.bench.context import BenchContext
from node.bench.probe import idle_by_core, tree_cpu
from node.bench.report import Plot, Section, Series, Table
from node.bench.stats import percentiles, ratio
from node.config import WorkersSection
from node.model import resolve_model
from node.testing import REPO

MAX_TOKENS = 128
#: Six prompts of 26-39 tokens (with BOS), different from their first word on.
PROMPTS = (
    "Once upon a time, in a small village at the edge of a dark forest, there lived an "
    "old clockmaker who kept a secret. Every night, when the village was asleep, he",
    "Write a short story about a robot that learns to paint. The robot had lived in a "
    "factory all its life and had never seen the sky until one morning",
    "Here is a detailed guide to growing tomatoes in a small home garden, covering "
    "watering, sunlight, soil and pests. First,",
    "Explain to a ten-year-old how a steam engine works, step by step, with simple "
    "words and an example from everyday life.",
    "The spaceship's engines went quiet as Captain Mara looked down at the red planet. "
    "She turned to her crew and said,",
    "Describe a busy morning at a harbor market: the fishermen, the smell of the sea, "
    "the gulls, and the traders calling out their prices.",
)
#: The warm-up's prompt: none of PROMPTS, so no measured request reuses its KV.
WARMUP_PROMPT = "A list of ten things you can find in a kitchen drawer:"
#: Requests per client at each level: each level takes ~15-40 s here.
REQUESTS_PER_CLIENT = {1: 6, 2: 4, 4: 3, 8: 2}
QUICK_LEVELS = (1, 4)
PERCENTILE_METHOD = "nearest rank (node.bench.stats.percentiles)"


# ---------------------------------------------------------------------- measuring


def own_seconds(pids: Sequence[int]) -> float:
    """CPU seconds used so far by this process and by ``pids`` and their descendants."""
    return sum(os.times()[:2]) + sum(map(tree_cpu, pids))


def _idle_seconds(cpus: Sequence[int]) -> float:
    """Seconds ``cpus`` have been idle since boot, all together."""
    idle = idle_by_core()
    return sum(idle.get(c, 0.0) for c in cpus)


def outside_load(cpus: Sequence[int], pids: Sequence[int]) -> Callable[[float], float]:
    """Start watching ``cpus``; the returned function takes the wall time (s) since
    and gives the cores other processes kept busy there meanwhile (CPU time on
    ``cpus`` not spent by this process or the backend's). The cores' busy time is
    the wall time less their idle time (``node.bench.probe.idle_by_core``: the
    tick-sampled busy columns under-count periodic work)."""
    idle, own = _idle_seconds(cpus), own_seconds(pids)

    def stop(wall: float) -> float:
        busy = wall * len(cpus) - (_idle_seconds(cpus) - idle)
        spent = busy - (own_seconds(pids) - own)
        return max(0.0, spent / wall)

    return stop


def run_batch(
    backend: Backend, level: int, per_client: int, max_tokens: int, prompts: Sequence[str]
) -> tuple[float, list[Outcome]]:
    """``level`` clients, each sending ``per_client`` requests back to back; returns the
    wall time (s) from the first send to the last reply and every request's outcome.

    Client c's j-th request takes prompt (j * level + c) mod len(prompts), the same on
    every backend.
    """
    outcomes: list[Outcome] = []
    errors: list[BaseException] = []
    gate = threading.Barrier(level + 1)

    def client(c: int) -> None:
        try:
            with backend.session() as ask:
                gate.wait()
                for j in range(per_client):
                    outcomes.append(ask(prompts[(j * level + c) % len(prompts)], max_tokens))
        except BaseException as exc:  # reported on the main thread
            errors.append(exc)
            with contextlib.suppress(threading.BrokenBarrierError):
                gate.abort()

    threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(level)]
    for t in threads:
        t.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        gate.wait()
    start = time.monotonic()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    if errors:
        raise RuntimeError(f"{backend.name} at {level} concurrent: {errors[0]!r}") from errors[0]
    return wall, outcomes


def measure(
    backend: Backend,
    level: int,
    per_client: int,
    cpus: Sequence[int],
    round_: int,
    max_tokens: int = MAX_TOKENS,
) -> dict[str, Any]:
    """Start ``backend``, warm it up, run one batch of requests of at most ``max_tokens``
    generated tokens, stop it; the run's raw numbers (tokens/s, TTFT p50/p99 in ms, ...)."""
    started, version = time.monotonic(), code_version()
    pids = backend.start(level)
    try:
        pinning = affinities(pids)
        # Warm-up, a short answer per client and per slot: a worker's first request
        # pages the weights in, and a node with more slots than clients would
        # otherwise serve some measured requests on a cold worker.
        run_batch(backend, max(level, backend.sequences()), 1, 8, [WARMUP_PROMPT])
        watch = outside_load(cpus, pids)
        wall, outcomes = run_batch(backend, level, per_client, max_tokens, PROMPTS)
        outside = watch(wall)
        details = backend.details()
    finally:
        backend.stop()
    tokens = sum(o.tokens for o in outcomes)
    ttft = percentiles(o.ttft_s * 1000 for o in outcomes) or {}
    allowed = cpu_list(cpus)
    stray = {
        mask: p
        for mask, p in pinning.items()
        if not set(mask.split(",")) <= set(allowed.split(","))
    }
    if stray:
        print(f"  warning: {backend.name}: threads outside {allowed}: {stray}", file=sys.stderr)
    row = {
        "backend": backend.name,
        "round": round_,
        "level": level,
        "requests": len(outcomes),
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_p50_ms": round(ttft.get("p50", 0.0), 1),
        "ttft_p99_ms": round(ttft.get("p99", 0.0), 1),
        "outside_cores": round(outside, 2),
        # requests whose prompt KV the server reused beyond the BOS token
        "reused_prompts": sum(1 for o in outcomes if (o.cached or 0) > 1),
        "outcomes": [asdict(o) for o in outcomes],
        "affinity": pinning,
        "details": details,
        "elapsed_s": round(time.monotonic() - started, 1),
        "code": version,
    }
    print(
        f"  round {round_} level {level} {backend.name:<18} {row['tokens_per_s']:7.2f} tok/s  "
        f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms p99 {row['ttft_p99_ms']:8.1f} ms  "
        f"({len(outcomes)} requests, {tokens} tokens, {wall:.1f} s, outside load "
        f"{outside:.2f} cores)",
        file=sys.stderr,
        flush=True,
    )
    return row


# ---------------------------------------------------------------------- building llama-server


def build_llama_server(directory: Path) -> Path:
    """Download llama-cpp-python's sdist (the installed version), build llama-server
    from its vendored llama.cpp, return the binary; steps already done are skipped."""
    version = importlib.metadata.version("llama-cpp-python")
    directory.mkdir(parents=True, exist_ok=True)
    src = directory / f"llama_cpp_python-{version}"
    binary = src / "vendor" / "llama.cpp" / "build" / "bin" / "llama-server"
    if binary.is_file():
        return binary
    sdist = directory / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*pip, f"llama-cpp-python=={version}", "-d", str(directory)], check=True)
    if not src.is_dir():
        subprocess.run(["tar", "-xzf", str(sdist), "-C", str(directory)], check=True)
    llama = src / "vendor" / "llama.cpp"
    cmake = ["cmake", "-S", str(llama), "-B", str(llama / "build")]
    subprocess.run([*cmake, "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"], check=True)
    jobs = str(len(os.sched_getaffinity(0)))
    build = ["cmake", "--build", str(llama / "build"), "--target", "llama-server", "-j", jobs]
    subprocess.run(build, check=True)
    return binary


def prompt_tokens(model: Path) -> list[int]:
    """Each prompt's length in the model's tokens (with BOS), from its vocabulary alone."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), vocab_only=True, verbose=False)
    return [len(llm.tokenize(p.encode())) for p in PROMPTS]


def code_version() -> str:
    """The checkout's commit, with ``+dirty.<hash of the changes>`` when broker/, node/ or
    fallback/ differ from it (other people edit this tree while benchmarks run)."""
    git = ["git", "-C", str(REPO)]
    paths = ["--", "broker", "node", "fallback"]

    def out(*args: str) -> str:
        return subprocess.run([*git, *args], capture_output=True, text=True).stdout

    head = out("rev-parse", "--short", "HEAD").strip()
    changes = out("diff", "HEAD", *paths) + out("status", "--porcelain", *paths)
    digest = hashlib.sha1(changes.encode()).hexdigest()[:8]
    return head + (f"+dirty.{digest}" if changes else "")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


# ---------------------------------------------------------------------- the scenario

LEVELS = (1, 2, 4, 8)
QUICK_MAX_TOKENS = 32


def steps(ctx: BenchContext) -> int:
    """Progress steps of ``run``: one per backend and level."""
    if ctx.engine != "llama":
        return 0
    return len(ctx.pick(QUICK_LEVELS, LEVELS)) * (2 + (ctx.llama_server is not None))


def run(ctx: BenchContext) -> Section:
    """Every backend at every level, one round (module docstring)."""
    title = "Model throughput and TTFT"
    if ctx.engine != "llama":
        return Section("throughput", title, skipped="needs the model (`--engine llama`)")
    cpus = default_cores()
    threads = len(cpus)
    levels = ctx.pick(QUICK_LEVELS, LEVELS)
    max_tokens = ctx.pick(QUICK_MAX_TOKENS, MAX_TOKENS)
    model = resolve_model("default")
    w = WorkersSection()
    slots = w.slots if isinstance(w.slots, int) else 4
    tmp = Path(tempfile.mkdtemp(prefix="bench-tp-"))
    backends: list[Backend] = [
        NodeBackend(w.count, slots, w.threads, cpus, 0, False, "default"),
        DirectBackend(model, threads, cpus, 0, False, "default", tmp),
    ]
    if ctx.llama_server is not None:
        backends.append(ServerBackend(ctx.llama_server, model, threads, cpus, 0, False, [], tmp))
    rows: list[dict[str, Any]] = []
    try:
        for level in levels:
            per_client = REQUESTS_PER_CLIENT[level]
            if ctx.quick:
                per_client = max(1, per_client // 3)
            for backend in backends:
                ctx.step(f"throughput: {backend.name}, {level} concurrent")
                rows.append(measure(backend, level, per_client, cpus, 0, max_tokens))
    finally:
        for backend in backends:
            backend.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return section([b.name for b in backends], levels, rows, max_tokens)


def section(
    names: list[str], levels: Sequence[int], rows: list[dict[str, Any]], max_tokens: int
) -> Section:
    """The report of ``run``'s measurements: per level each backend's tokens/s, TTFT
    p50/p99 and the node's tokens/s as a share of each baseline's."""
    at = {(r["backend"], r["level"]): r for r in rows}
    node, baselines = names[0], names[1:]
    headers = ["concurrent", "backend", "tokens/s", "node / this", "TTFT p50 ms", "TTFT p99 ms"]
    table_rows = []
    for level in levels:
        ours = at[(node, level)]
        for name in names:
            r = at[(name, level)]
            share = ratio(ours["tokens_per_s"], r["tokens_per_s"])
            table_rows.append(
                (
                    level,
                    name,
                    r["tokens_per_s"],
                    "-" if name == node or share is None else f"{100 * share:.0f} %",
                    r["ttft_p50_ms"],
                    r["ttft_p99_ms"],
                )
            )
    plots = [
        Plot(
            "throughput",
            "aggregate tokens/s by concurrent requests",
            "concurrent requests",
            "tokens/s",
            [
                Series(n, list(levels), [at[(n, lv)]["tokens_per_s"] for lv in levels])
                for n in names
            ],
        ),
        Plot(
            "ttft",
            "time to first token, p50",
            "concurrent requests",
            "ms",
            [Series(n, list(levels), [at[(n, lv)]["ttft_p50_ms"] for lv in levels]) for n in names],
        ),
    ]
    text = (
        f"Backends: {', '.join(names)}; greedy, at most {max_tokens} tokens per request, "
        f"closed-loop clients; the baselines are {', '.join(baselines)} on the same cores. "
        f"TTFT percentiles: {PERCENTILE_METHOD}."
    )
    lean = [{k: v for k, v in r.items() if k != "outcomes"} for r in rows]
    data = {"backends": names, "levels": list(levels), "max_tokens": max_tokens, "runs": lean}
    return Section(
        "throughput",
        "Model throughput and TTFT",
        text,
        [Table(headers, table_rows)],
        [],
        plots,
        data,
    )
