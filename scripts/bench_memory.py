#!/usr/bin/env python3
"""Planned vs measured memory per worker layout, workers x slots (a benchmark, not a test).

For each layout ``WxS`` (W model workers of S slots each), starts a real node
(``edgenode start --foreground`` with the llama engine and the default model, in a
private run dir, ``workers.memory_max = "max"`` so no limit shapes what is
measured), puts W x S context-filling prompts in flight at once, so every slot of
every worker holds a full-context sequence (its KV cache and the attention scratch
fully touched: the steady-state peak), checks from ``status`` that each worker
really had S requests at once, then compares each model worker with the plan of
``node.capacity.plan`` (``config_plan`` of the node's own config, as ``edgenode start``
computed it), against ``plan.per_worker`` less the grammar allowance (these
prompts carry no ``json_schema``; ``scripts/bench_grammar.py`` measures that term):

* cgroup: the worker's own cgroup, its peak (v2 ``memory.peak``, v1
  ``memory.max_usage_in_bytes``; the current usage where the kernel has no peak)
  and its working set (usage less inactive page cache), from ``status``;
* private: anonymous memory and file pages only this worker maps (``smaps``
  Private_Clean + Private_Dirty), less the model file's private pages;
* PSS (what the worker costs the host, shared pages split among their users) less
  the model file's share; the model file's PSS is shown apart.

Each layout's total (model workers' PSS without the model file + the model file's
resident bytes, counted once: the largest RSS of its mapping in any node process,
since the workers map the same page cache) is set against ``plan.total`` less the
grammar. The model file's PSS is not summed for that: a process outside the node
mapping the same file (another node on the host) would take a share of it. The
rule worker (``rules-0``) and the node process are reported apart: they are not
model workers, and the plan covers them elsewhere (the node's own runtime). The
target is every measurement within +-5 % of the plan. On cgroup v1 a worker's pages
from before it joined its cgroup (the interpreter's start) stay charged to the
node's cgroup (no ``memory.move_charge_at_immigrate``), so there the cgroup peak
reads below the private memory. The "impl.rt" column is what
``capacity.runtime_overhead`` + the attention scratch would have to be for the
private estimate to be exact (measured private - S x KV per sequence).

Usage: ``python scripts/bench_memory.py [--layouts 2x1,1x2,1x4] [--n-ctx 2048]
[--threads 1]``. A layout ``N`` alone means ``Nx1``. Layouts with S > 1 need the
multi-slot llama engine (``workers.slots`` reaching the worker).
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import psutil

from broker.client import Client
from node.bench.context import split_list
from node.capacity.plan import Plan, config_plan
from node.config import MAX_SLOTS, load_config
from node.model import resolve_model
from node.pool import RULES_WORKER
from node.testing import NodeProcess
from node.units import format_size

MiB = 1 << 20
#: How often status is polled while the prompts run, to see how many requests
#: each worker held at once (s).
POLL_S = 0.05


def parse_layouts(text: str) -> list[tuple[int, int]]:
    """``"2x1,1x2,1x4"`` -> ``[(2, 1), (1, 2), (1, 4)]`` (workers, slots); ``"2"`` is 2x1.

    Raises:
        ValueError: a layout that is not ``W`` or ``WxS`` with W >= 1, S in [1, 64].
    """
    layouts = []
    for item in split_list(text, "layout"):
        workers, _, slots = item.lower().partition("x")
        w, s = int(workers), int(slots or 1)
        if w < 1 or not 1 <= s <= MAX_SLOTS:
            raise ValueError(f"layout {item!r}: need workers >= 1 and slots in [1, {MAX_SLOTS}]")
        layouts.append((w, s))
    return layouts


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


def fill(node: NodeProcess, sequences: int, n_ctx: int) -> dict[str, Any]:
    """Put ``sequences`` context-filling prompts in flight at once and wait for them.

    Returns the wall time (s), the errors, and per worker the most requests it held
    at once (from ``status``, polled while they run).
    """
    prompt = "robot " * (n_ctx - 64)  # one token per word with the default model
    errors: list[str] = []

    def one() -> None:
        try:
            with Client(node.frontend, wait_ms=600_000) as client:
                # The model's route: the node's default may answer from the rules
                # when it predicts the model cannot (1x4 took 0.1 s with no slot busy).
                client.generate(prompt, max_tokens=16, timeout_ms=600_000, route="llm")
        except Exception as exc:  # reported below, the benchmark goes on
            errors.append(repr(exc))

    start = time.monotonic()
    threads = [threading.Thread(target=one) for _ in range(sequences)]
    for t in threads:
        t.start()
    most: dict[str, int] = {}
    while any(t.is_alive() for t in threads):
        try:
            for w in node.status().get("workers", []):
                most[w["worker_id"]] = max(most.get(w["worker_id"], 0), int(w.get("active", 0)))
        except Exception:  # a busy node may miss one poll; the next one counts
            pass
        time.sleep(POLL_S)
    for t in threads:
        t.join()
    return {"took_s": time.monotonic() - start, "errors": errors, "most_active": most}


def run(workers: int, slots: int, n_ctx: int, threads: int, timeout: float) -> dict[str, Any]:
    """One node of ``workers`` x ``slots``: its plan and the measured memory."""
    node = NodeProcess(
        {
            "workers": {
                "engine": "llama",
                "count": workers,
                "slots": slots,
                "threads": threads,
                "memory_max": "max",
            },
            "model": {"n_ctx": n_ctx},
            "broker": {"stall_timeout_ms": 120_000},
        }
    )
    try:
        node.start(timeout=timeout)
        plan, _ = config_plan(load_config(str(node.config)))
        filled = fill(node, workers * slots, n_ctx)
        time.sleep(0.5)
        status = node.status()
        model = str(resolve_model("default"))
        procs = [p for p in status["processes"] if p["pid"]]
        assert node.proc is not None
        return {
            "plan": plan,
            "workers": [measure(p, model) for p in procs if p["worker_id"] != RULES_WORKER],
            "rules": [measure(p, model) for p in procs if p["worker_id"] == RULES_WORKER],
            "node": smaps(node.proc.pid, model),
            "registered": {w["worker_id"]: w.get("slots") for w in status.get("workers", [])},
            "sandbox": status.get("sandbox") or {},
            **filled,
        }
    finally:
        node.cleanup()


def measure(proc: dict[str, Any], model: str) -> dict[str, Any]:
    """One worker: its smaps totals, its cgroup reading (None without cgroups), its id."""
    return {"id": proc["worker_id"], "pid": proc["pid"], "cgroup": proc.get("memory")} | smaps(
        proc["pid"], model
    )


def error_pct(estimate: int, measured: int) -> str:
    """The estimate's error against the measurement, ``+3.1%``."""
    return f"{(estimate - measured) / measured * 100:+.1f}%" if measured else "-"


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.1f}M"


def report(result: dict[str, Any]) -> dict[str, Any]:
    """Print one layout's table; returns its summary row."""
    plan: Plan = result["plan"]
    w, s = plan.workers, plan.slots
    print(f"\n== {w}x{s}: {w} worker(s) x {s} slot(s), n_ctx {plan.n_ctx} per slot")
    print(
        f"plan: kv {plan.kv_type}, weights {format_size(plan.weights)}"
        f" shared={plan.weights_shared}, "
        f"KV {s} x {format_size(plan.kv_per_seq)}, runtime {format_size(plan.runtime_per_worker)} "
        f"(overhead {format_size(plan.runtime_overhead)} + scratch {format_size(plan.scratch)}), "
        f"per worker {format_size(plan.per_worker)} (of it grammar {format_size(plan.grammar)}, "
        f"not used here), total {format_size(plan.total)}"
    )
    most = result["most_active"]
    held = ", ".join(f"{m['id']} {most.get(m['id'], 0)}/{s}" for m in result["workers"])
    announced = {k: v for k, v in result["registered"].items() if k != RULES_WORKER}
    print(
        f"in flight at once (most seen): {held}; slots announced {announced};"
        f" {result['took_s']:.1f} s"
    )
    if result["errors"]:
        print(f"  errors: {result['errors']}")
    if not result["sandbox"].get("cgroup"):
        why = result["sandbox"].get("reason") or "sandbox off"
        print(f"  no cgroups ({why}): the cgroup columns are empty")
    est = plan.per_worker - plan.grammar  # no json_schema here
    print(
        f"{'worker':>8} {'pid':>7} {'estimate':>9} {'cg peak':>9} {'err':>7} {'cg wset':>9} "
        f"{'private':>9} {'err':>7} {'PSS-model':>9} {'err':>7} {'model PSS':>9} {'impl.rt':>9}"
    )
    cg_sum, pss_sum = 0, 0
    for m in result["workers"]:
        reading = m["cgroup"] or {}
        peak = reading.get("peak") or reading.get("current")
        wset = None if not reading else reading["current"] - reading.get("inactive_file", 0)
        # Private excludes file pages other processes map too, so with one worker it
        # would also hold the weights, which nobody else maps: counted apart.
        private = m["Private"] - m["model_private"]
        pss = m["Pss"] - m["model_pss"]
        cg_sum += peak or 0
        pss_sum += pss
        print(
            f"{m['id']:>8} {m['pid']:>7} {mib(est):>9} {mib(peak):>9} "
            f"{error_pct(est, peak) if peak else '-':>7} {mib(wset):>9} {mib(private):>9} "
            f"{error_pct(est, private):>7} {mib(pss):>9} {error_pct(est, pss):>7} "
            f"{mib(m['model_pss']):>9} {mib(private - s * plan.kv_per_seq):>9}"
        )
    others = [("node", result["node"])] + [(m["id"], m) for m in result["rules"]]
    weights = max(p["model_rss"] for p in [*result["workers"], *(p for _, p in others)])
    planned = plan.total - w * plan.grammar
    measured_total = pss_sum + weights
    print(
        f"model workers: PSS without the model file {format_size(pss_sum)} + the model file"
        f" resident once {format_size(weights)} = {format_size(measured_total)}"
        f" vs plan total less grammar {format_size(planned)}"
        f" ({error_pct(planned, measured_total)});"
        f" cgroup peaks {format_size(cg_sum)} vs {format_size(w * est)}"
        f" ({error_pct(w * est, cg_sum) if cg_sum else '-'})"
    )
    for name, p in others:
        what = "the broker" if name == "node" else "the rule worker, not a model worker"
        print(
            f"{name}: PSS {format_size(p['Pss'])} ({what}; model file PSS in it"
            f" {format_size(p['model_pss'])}; its runtime is the node's, not the workers' plan)"
        )
    return {
        "layout": f"{w}x{s}",
        "sequences": plan.sequences,
        "planned": planned,
        "pss": measured_total,
        "cgroup": cg_sum,
        "cgroup_planned": w * est,
    }


def summary(rows: list[dict[str, Any]]) -> None:
    """One line per layout: planned and measured totals, and per sequence."""
    print(
        f"\n{'layout':>7} {'seqs':>5} {'plan':>9} {'PSS':>9} {'err':>7} {'PSS/seq':>9} "
        f"{'cg plan':>9} {'cg peak':>9} {'err':>7}"
    )
    for r in rows:
        print(
            f"{r['layout']:>7} {r['sequences']:>5} {mib(r['planned']):>9} {mib(r['pss']):>9} "
            f"{error_pct(r['planned'], r['pss']):>7} {mib(r['pss'] // r['sequences']):>9} "
            f"{mib(r['cgroup_planned']):>9} {mib(r['cgroup'] or None):>9} "
            f"{error_pct(r['cgroup_planned'], r['cgroup']) if r['cgroup'] else '-':>7}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--layouts",
        type=parse_layouts,
        default=parse_layouts("1x1,2x1"),
        help="comma-separated WORKERSxSLOTS layouts, e.g. 2x1,1x2,1x4 (default 1x1,2x1)",
    )
    parser.add_argument("--n-ctx", type=int, default=2048, help="model.n_ctx (per slot)")
    parser.add_argument("--threads", type=int, default=1, help="workers.threads")
    parser.add_argument("--timeout", type=float, default=240.0, help="node start timeout (s)")
    args = parser.parse_args()
    print(f"host: {psutil.cpu_count()} CPUs, {format_size(psutil.virtual_memory().total)} RAM")
    rows = [report(run(w, s, args.n_ctx, args.threads, args.timeout)) for w, s in args.layouts]
    summary(rows)


if __name__ == "__main__":
    main()
