#!/usr/bin/env python3
"""Throughput and time to first token: the node vs llama-cpp-python vs llama-server
(a benchmark, not a test; its targets and last figures: README, "Performance").

What is measured (tokens/s and TTFT p50/p99 at 1, 2, 4 and 8 concurrent requests, the
same prompts and greedy 128-token generations for every backend) is written once, in
``node.bench.throughput``'s docstring; ``edgenode bench --only throughput`` runs the
same measurement. This script adds what a study needs: layouts, rounds, pinning,
repacking and flash attention per backend.

Prompt caching, the backends (``node WxS``, ``direct``, ``llama-server`` and their
``-nr`` variants), ``--flash-attn``, pinning to ``--cpus``, ``--nice``, warm-up,
interleaved rounds and the outside-load retries are described there too.

Output: Markdown tables on stdout and in ``--out`` (default
``docs/bench/throughput.md``), and every raw number in the same path with
``.json``. This file drives the rounds; the measuring and the backends are
``node.bench.throughput`` and ``node.bench.backends`` (shared with ``edgenode bench``),
the report is ``scripts/throughput_report.py``.

Usage::

    python scripts/bench_throughput.py --layout 2x1 --layout 1x4 \\
        --llama-server /path/to/llama-server [--rounds 3] [--threads 2] [--cpus 0,1]
    python scripts/bench_throughput.py --quick ...   # 1 round, levels 1 and 4, fewer requests

Build llama-server from the llama.cpp llama-cpp-python vendors (what
``--build-llama-server DIR`` does, reusing what DIR already holds; 10-20 minutes on 2
cores)::

    pip download --no-deps --no-binary :all: llama-cpp-python==$(pip show llama-cpp-python \\
        | sed -n 's/^Version: //p') -d DIR
    tar -xzf DIR/llama_cpp_python-*.tar.gz -C DIR
    cmake -S DIR/llama_cpp_python-*/vendor/llama.cpp -B .../build -DCMAKE_BUILD_TYPE=Release \\
        -DLLAMA_CURL=OFF
    cmake --build .../build --target llama-server -j "$(nproc)"   # -> build/bin/llama-server
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from node.bench.backends import (
    Backend,
    DirectBackend,
    NodeBackend,
    ServerBackend,
    cpu_list,
    default_cores,
)
from node.bench.context import list_type
from node.bench.throughput import (
    MAX_TOKENS,
    PERCENTILE_METHOD,
    PROMPTS,
    QUICK_LEVELS,
    REQUESTS_PER_CLIENT,
    build_llama_server,
    cpu_model,
    measure,
    prompt_tokens,
)
from node.config import WorkersSection
from node.model import resolve_model
from node.sandbox.cores import parse_cpus
from throughput_report import markdown, summarize

REPO = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------------- main


def layout(text: str) -> tuple[int, int]:
    """``WxS`` (workers x slots) or ``W``."""
    w, _, s = text.partition("x")
    workers, slots = int(w), int(s or 1)
    if workers < 1 or slots < 1:
        raise argparse.ArgumentTypeError(f"layout {text!r}: need workers >= 1 and slots >= 1")
    return workers, slots


def cores(text: str) -> list[int]:
    """``0,1`` or ``0-3`` (the kernel's cpu-list format, ``parse_cpus``)."""
    return list(parse_cpus(text))


#: Without ``--layout``: the node's default layout (``workers.count`` x ``workers.slots``).
DEFAULT_LAYOUT = (WorkersSection.count, int(WorkersSection.slots))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--layout",
        type=layout,
        action="append",
        help="node WxS (repeatable; default: the node's, {}x{})".format(*DEFAULT_LAYOUT),
    )
    parser.add_argument("--threads", type=int, help="threads (default: one per core of --cpus)")
    parser.add_argument(
        "--cpus",
        type=cores,
        help="cores, e.g. 0,1 (default: the node's default workers.cpus = auto: every "
        "allowed core but the first, on this 2-core machine core 1)",
    )
    parser.add_argument(
        "--levels",
        type=list_type("level", int),
        help="concurrency levels, e.g. 1,2,4,8 (the default)",
    )
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 3)")
    parser.add_argument("--nice", type=int, default=0, help="nice level of every backend")
    parser.add_argument(
        "--max-outside-load",
        type=float,
        default=0.25,
        help="measure a level again when other processes kept more cores busy (default 0.25)",
    )
    parser.add_argument("--retries", type=int, default=2, help="at most this many times")
    parser.add_argument("--repack", choices=("on", "off", "both"), default="both")
    parser.add_argument("--node-repack", action="store_true", help="model.repack = true")
    parser.add_argument(
        "--flash-attn",
        choices=("default", "on", "off"),
        default="default",
        help="flash attention in every backend (node model.flash_attn, Llama(flash_attn=), "
        "llama-server -fa); default: each backend's own default (node on, llama-cpp-python off, "
        "llama-server auto = on)",
    )
    parser.add_argument("--llama-server", type=Path, help="a built llama-server binary")
    parser.add_argument("--build-llama-server", type=Path, metavar="DIR")
    parser.add_argument(
        "--llama-server-arg", action="append", default=[], help="extra llama-server argument"
    )
    parser.add_argument(
        "--backends",
        type=list_type("backend", str),
        default=["node", "direct", "llama-server"],
        help="comma-separated (default node,direct,llama-server)",
    )
    parser.add_argument("--quick", action="store_true", help="1 round, levels 1 and 4, fewer")
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "docs" / "bench" / "throughput.md",
        help="the Markdown report (the raw JSON goes beside it, .json)",
    )
    args = parser.parse_args(argv)
    if args.out.is_dir():  # found after a 25-minute run otherwise
        parser.error(f"--out {args.out} is a directory: give the report's file name")
    return args


def terminated(signum: int, _frame: object) -> None:
    """SIGTERM: stop like Ctrl-C (backends stopped, the runs so far written as partial);
    a second SIGTERM during that cleanup is ignored (SIGKILL still works)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt(f"signal {signum}")


def quietest(
    backend: Backend,
    level: int,
    per_client: int,
    cpus: Sequence[int],
    round_: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """Measure once, and again (up to ``--retries`` times) while other processes kept
    more than ``--max-outside-load`` cores busy; the quietest attempt's row, with the
    others under ``discarded``."""
    attempts: list[dict[str, Any]] = []
    for attempt in range(1, args.retries + 2):
        row = measure(backend, level, per_client, cpus, round_)
        row["attempt"] = attempt
        attempts.append(row)
        if row["outside_cores"] <= args.max_outside_load:
            break
        again = "" if attempt > args.retries else ": measuring again"
        print(
            f"  outside load {row['outside_cores']:.2f} cores > {args.max_outside_load}{again}",
            file=sys.stderr,
        )
    best = min(attempts, key=lambda a: a["outside_cores"])
    best["discarded"] = [a for a in attempts if a is not best]
    return best


def round_order(backends: Sequence[Backend], round_: int) -> list[Backend]:
    """The order of round ``round_``: as given in even rounds, reversed in odd ones
    (ABC, CBA, ...), so that a machine whose speed drifts within a round favours
    no backend by its position (on the Zen VMs of 2026-12 the last place was the
    fastest; the node, listed first, always ran first)."""
    return list(backends) if round_ % 2 == 0 else list(reversed(backends))


def main() -> None:
    args = parse_args()
    cpus: list[int] = args.cpus or default_cores()
    threads: int = args.threads or len(cpus)
    default_levels = QUICK_LEVELS if args.quick else tuple(REQUESTS_PER_CLIENT)
    levels: list[int] = args.levels or list(default_levels)
    per_client = {lv: REQUESTS_PER_CLIENT.get(lv, max(1, 16 // lv)) for lv in levels}
    if args.quick:  # a third of the requests
        per_client = {lv: max(1, n // 3) for lv, n in per_client.items()}
    rounds: int = args.rounds or (1 if args.quick else 3)
    wanted: list[str] = args.backends
    variants = {"on": [True], "off": [False], "both": [True, False]}[args.repack]
    model = resolve_model("default")
    lengths = prompt_tokens(model)
    zmq.Context.instance().socket(zmq.DEALER).close()  # zmq's I/O thread before any pinning
    tmp = Path(tempfile.mkdtemp(prefix="bench-tp-"))

    backends: list[Backend] = []
    flash: str = args.flash_attn
    if "node" in wanted:
        for w, s in args.layout or [DEFAULT_LAYOUT]:
            backends.append(NodeBackend(w, s, threads, cpus, args.nice, args.node_repack, flash))
    if "direct" in wanted:
        backends += [
            DirectBackend(model, threads, cpus, args.nice, r, flash, tmp) for r in variants
        ]
    if "llama-server" in wanted:
        binary = args.llama_server
        if args.build_llama_server:
            binary = build_llama_server(args.build_llama_server)
        if binary is None:
            raise SystemExit("give --llama-server PATH or --build-llama-server DIR")
        if not binary.is_file():
            raise SystemExit(f"{binary} does not exist (still building?)")
        fa = [] if flash == "default" else ["-fa", flash]
        extra = [*fa, *args.llama_server_arg]
        backends += [
            ServerBackend(binary, model, threads, cpus, args.nice, r, extra, tmp) for r in variants
        ]

    runs: list[dict[str, Any]] = []
    details: dict[str, dict[str, Any]] = {}
    signal.signal(signal.SIGTERM, terminated)
    interrupted = False
    try:
        for r in range(rounds):
            for level in levels:
                for backend in round_order(backends, r):
                    runs.append(quietest(backend, level, per_client[level], cpus, r, args))
                    details.setdefault(backend.name, runs[-1]["details"])
    except KeyboardInterrupt:
        interrupted = True
        print(f"interrupted after {len(runs)} measurements", file=sys.stderr)
    finally:
        for backend in backends:
            backend.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    if not runs:
        raise SystemExit(1)

    meta = {
        "command": " ".join(["python scripts/bench_throughput.py", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "code": sorted({r["code"] for r in runs}),
        "cpu": cpu_model(),
        "cpus": cpu_list(cpus),
        "threads": threads,
        "nice": args.nice,
        "flash_attn": args.flash_attn,
        "model": str(model),
        "model_name": model.name,
        "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
        "rounds": rounds,
        "levels": levels,
        "max_outside_load": args.max_outside_load,
        "retries": args.retries,
        "requests_per_client": {lv: per_client[lv] for lv in levels},
        "max_tokens": MAX_TOKENS,
        "prompts": list(PROMPTS),
        "prompt_tokens": lengths,
        "llama_server_build": next(
            (d.get("build_info") for d in details.values() if d.get("build_info")), None
        ),
        "percentiles": PERCENTILE_METHOD,
        "backends": details,
    }
    summary = summarize(runs, levels)
    text = markdown(summary, meta, levels)
    out: Path = args.out
    if interrupted:  # keep a finished run's report; this one is incomplete
        out = out.with_name(out.stem + ".partial" + out.suffix)
        text = text.replace("\n\n", f"\n\n**Interrupted after {len(runs)} measurements.**\n\n", 1)
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    raw = {"meta": meta, "summary": summary, "runs": runs, "interrupted": interrupted}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=1) + "\n")
    print(f"wrote {out} and {out.with_suffix('.json')}", file=sys.stderr)
    if interrupted:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
