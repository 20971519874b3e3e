#!/usr/bin/env python3
"""Estimated vs measured memory per worker (a benchmark, not a test).

For each worker count, starts a real node (``edgenode start --foreground`` with
the llama engine and the default model, in a private run dir), drives every
worker through one prompt that fills its context (so the KV cache and the
attention scratch are fully touched, the steady-state peak), then reads each
worker's memory from ``/proc/<pid>/smaps`` and compares it with the plan of
``node.capacity``:

* private = anonymous memory + file pages only this worker maps (psutil's USS,
  plus its share of shared anonymous pages), against ``plan.per_worker`` less
  the grammar allowance (these prompts carry no ``json_schema``;
  ``scripts/bench_grammar.py`` measures that term);
* PSS (what the worker costs the host, shared pages split among their users)
  against the same estimate ``+ plan.shared_weights / N``;
* the model file's mapping on its own: resident, proportional and private
  bytes, which shows the weights shared (mmap) rather than copied.

The target is each estimate within +-10 % of the measurement. The "implied
runtime" column is what ``capacity.runtime_overhead`` would have to be for the
private estimate to be exact (measured private - KV - attention scratch).

Usage: ``python scripts/bench_memory.py [--workers 1,2] [--n-ctx 2048]``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from broker.client import Client
from node.capacity import Plan, config_plan
from node.config import load_config
from node.model import resolve_model
from node.units import format_size

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from nodeproc import NodeProcess

MiB = 1 << 20


def smaps(pid: int, model: str) -> dict[str, int]:
    """Bytes from ``/proc/<pid>/smaps``: totals, and the model file's mapping alone."""
    out = dict.fromkeys(("Rss", "Pss", "Anonymous", "Private", "model_rss", "model_pss"), 0)
    out["model_private"] = 0
    current = ""
    with open(f"/proc/{pid}/smaps") as fh:
        for line in fh:
            head, _, rest = line.partition(":")
            if " " in head or "-" in head:  # a mapping header: "addr-addr perms ... path"
                current = line.split(maxsplit=5)[5].strip() if len(line.split()) > 5 else ""
                continue
            if not rest.strip().endswith("kB"):
                continue
            kib = int(rest.split()[0]) * 1024
            is_model = current == model
            if head in ("Rss", "Pss", "Anonymous"):
                out[head] += kib
            if head in ("Private_Clean", "Private_Dirty"):
                out["Private"] += kib
                out["model_private"] += kib if is_model else 0
            if is_model and head in ("Rss", "Pss"):
                out[f"model_{head.lower()}"] += kib
    return out


def warm(frontend: str, workers: int, n_ctx: int) -> float:
    """Send one context-filling prompt per worker at once; returns the wall time (s)."""
    prompt = "robot " * (n_ctx - 64)  # one token per word with the default model
    errors: list[str] = []

    def one() -> None:
        try:
            with Client(frontend, wait_ms=300_000) as client:
                client.generate(prompt, max_tokens=16, timeout_ms=300_000)
        except Exception as exc:  # reported below, the benchmark goes on
            errors.append(repr(exc))

    start = time.monotonic()
    threads = [threading.Thread(target=one) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        print(f"  warm-up errors: {errors}")
    return time.monotonic() - start


def pct(estimate: int, measured: int) -> str:
    return f"{(estimate - measured) / measured * 100:+.1f}%"


def run(workers: int, n_ctx: int, timeout: float) -> dict[str, Any]:
    """One node with ``workers`` workers: its plan and the measured memory."""
    node = NodeProcess(
        {
            "workers": {"engine": "llama", "count": workers, "threads": 1},
            "model": {"n_ctx": n_ctx},
            "broker": {"stall_timeout_ms": 60_000},
        }
    )
    try:
        node.start(timeout=timeout)
        plan, _ = config_plan(load_config(str(node.config)))
        took = warm(node.frontend, workers, n_ctx)
        time.sleep(0.5)
        model = str(resolve_model("default"))
        pids = node.worker_pids()
        measured = [smaps(pid, model) for pid in pids]
        assert node.proc is not None
        broker = smaps(node.proc.pid, model)
        return {"plan": plan, "workers": measured, "broker": broker, "pids": pids, "warm_s": took}
    finally:
        node.cleanup()


def report(n: int, result: dict[str, Any]) -> None:
    plan: Plan = result["plan"]
    warm_s = result["warm_s"]
    print(f"\n== {n} worker(s), n_ctx {plan.n_ctx}, kv {plan.kv_type} (warm-up {warm_s:.1f} s)")
    print(
        f"plan: weights {format_size(plan.weights)} shared={plan.weights_shared}, "
        f"KV/seq {format_size(plan.kv_per_seq)}, runtime {format_size(plan.runtime_per_worker)} "
        f"(overhead {format_size(plan.runtime_overhead)} + scratch {format_size(plan.scratch)}), "
        f"per worker {format_size(plan.per_worker)} (of it grammar {format_size(plan.grammar)}, "
        f"not used here), total {format_size(plan.total)}"
    )
    est_priv = plan.per_worker - plan.grammar  # no json_schema here
    est_pss = est_priv + plan.shared_weights // n
    est_total = plan.total - n * plan.grammar
    print(
        f"{'pid':>7} {'est priv':>9} {'private':>9} {'err':>7} {'anon':>9} "
        f"{'est PSS':>9} {'PSS':>9} {'err':>7} {'impl.rt':>9} "
        f"{'model RSS':>10} {'model PSS':>10} {'model priv':>10}"
    )
    total_pss = 0
    for pid, m in zip(result["pids"], result["workers"], strict=True):
        # Private excludes file pages other processes map too, so with one worker it
        # also holds the weights, which nobody else maps.
        private = m["Private"] - m["model_private"]
        implied = private - plan.kv_per_seq - plan.scratch
        total_pss += m["Pss"]
        print(
            f"{pid:>7} {est_priv / MiB:>8.1f}M {private / MiB:>8.1f}M "
            f"{pct(est_priv, private):>7} {m['Anonymous'] / MiB:>8.1f}M "
            f"{est_pss / MiB:>8.1f}M {m['Pss'] / MiB:>8.1f}M {pct(est_pss, m['Pss']):>7} "
            f"{implied / MiB:>8.1f}M {m['model_rss'] / MiB:>9.1f}M "
            f"{m['model_pss'] / MiB:>9.1f}M {m['model_private'] / MiB:>9.1f}M"
        )
    broker = result["broker"]
    print(
        f"workers' PSS sum {format_size(total_pss)} vs plan total less grammar "
        f"{format_size(est_total)} ({pct(est_total, total_pss)}); "
        f"broker process PSS {format_size(broker['Pss'])} "
        f"(model file PSS in it {format_size(broker['model_pss'])}; not in the plan, "
        "covered by capacity.reserve)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--timeout", type=float, default=240.0, help="node start timeout (s)")
    args = parser.parse_args()
    print(f"host: {psutil.cpu_count()} CPUs, {format_size(psutil.virtual_memory().total)} RAM")
    for n in (int(x) for x in args.workers.split(",")):
        report(n, run(n, args.n_ctx, args.timeout))


if __name__ == "__main__":
    main()
