"""The report of ``scripts/bench_throughput.py``: its runs summarized (medians over
rounds, same-round ratios) and written as Markdown.

Pure functions of the rows ``bench_throughput`` measured and the ``meta`` it records
(the same dicts its JSON holds); they start nothing and read no clock.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from node.bench.stats import percentile


def median_of(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows]
    return percentile(values, 50) if values else None


def summarize(runs: list[dict[str, Any]], levels: Sequence[int]) -> dict[str, Any]:
    """Per backend and level: medians over rounds; per node layout, baseline and level:
    the median of the same-round tokens/s ratios."""
    backends = list(dict.fromkeys(r["backend"] for r in runs))
    cells: dict[str, dict[int, dict[str, float | None]]] = {}
    for b in backends:
        cells[b] = {}
        for level in levels:
            rows = [r for r in runs if r["backend"] == b and r["level"] == level]
            cells[b][level] = {
                k: median_of(rows, k) for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")
            }
    ratios: dict[str, dict[str, dict[int, float | None]]] = {}
    for n in (b for b in backends if b.startswith("node")):
        ratios[n] = {}
        for base in (b for b in backends if not b.startswith("node")):
            ratios[n][base] = {}
            for level in levels:
                per_round = []
                for r in runs:
                    if r["backend"] != n or r["level"] != level:
                        continue
                    other = [
                        o
                        for o in runs
                        if o["backend"] == base and o["level"] == level and o["round"] == r["round"]
                    ]
                    if other and other[0]["tokens_per_s"]:
                        per_round.append(r["tokens_per_s"] / other[0]["tokens_per_s"])
                ratios[n][base][level] = percentile(per_round, 50) if per_round else None
    loads = {b: [r["outside_cores"] for r in runs if r["backend"] == b] for b in backends}
    outside = {b: {"median": percentile(v, 50), "max": max(v)} for b, v in loads.items() if v}
    return {"backends": backends, "cells": cells, "ratios": ratios, "outside_cores": outside}


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def markdown(summary: dict[str, Any], meta: dict[str, Any], levels: Sequence[int]) -> str:
    """The report: setup, tokens/s, TTFT, ratios."""
    backends: list[str] = summary["backends"]
    cells = summary["cells"]
    tokens = meta["prompt_tokens"]
    per_client = ", ".join(f"{n} at {lv}" for lv, n in meta["requests_per_client"].items())
    out = [
        "# Throughput and TTFT: edgenode vs llama-cpp-python vs llama-server",
        "",
        f"`{meta['command']}`",
        "",
        f"- {meta['date']}, {meta['cpu']}, cores {meta['cpus']}, {meta['threads']} threads per "
        f"process (node workers: as below), nice {meta['nice']} for every backend, flash "
        f"attention: {FLASH_ATTN_WORDS[meta.get('flash_attn', 'default')]}.",
        f"- Code {', '.join(meta['code'])}"
        + (" (**it changed during the run**)" if len(meta["code"]) > 1 else "")
        + f"; model `{meta['model_name']}`, llama-cpp-python {meta['llama_cpp_python']}"
        + (f", llama-server {meta['llama_server_build']}" if meta["llama_server_build"] else "")
        + ".",
        f"- {meta['max_tokens']}-token greedy generations (temperature 0) from {len(tokens)} "
        f"prompts of {min(tokens)}-{max(tokens)} tokens, cycled; requests per client: {per_client} "
        "concurrent; tokens/s = generated tokens / wall time of the level's batch.",
        f"- {meta['rounds']} round(s), interleaved; every number is the median over rounds. "
        f"TTFT percentiles by {meta['percentiles']} over all requests of a level (with so few "
        "requests, p99 is the slowest).",
        "",
        "Backends:",
        "",
    ]
    for b, d in meta["backends"].items():
        out.append(f"- **{b}**: {describe(d)}")
    loads = summary["outside_cores"]
    out += [
        "",
        "Outside load (cores kept busy on the measured cores by other processes during the "
        "measured batches; 0 on an idle machine): "
        + ", ".join(f"{b} median {v['median']:.2f}, max {v['max']:.2f}" for b, v in loads.items())
        + f". A measurement over {meta['max_outside_load']} cores was repeated up to "
        f"{meta['retries']} times, the quietest kept.",
    ]
    out += ["", "Aggregate tokens/s:", ""]
    out.append("| concurrent | " + " | ".join(backends) + " |")
    out.append("|---" * (len(backends) + 1) + "|")
    for level in levels:
        row = [fmt(cells[b][level]["tokens_per_s"]) for b in backends]
        out.append(f"| {level} | " + " | ".join(row) + " |")
    out += ["", "TTFT p50 / p99 (ms):", ""]
    out.append("| concurrent | " + " | ".join(backends) + " |")
    out.append("|---" * (len(backends) + 1) + "|")
    for level in levels:
        row = [
            f"{fmt(cells[b][level]['ttft_p50_ms'], 0)} / {fmt(cells[b][level]['ttft_p99_ms'], 0)}"
            for b in backends
        ]
        out.append(f"| {level} | " + " | ".join(row) + " |")
    ratios = summary["ratios"]
    bases = list(next(iter(ratios.values()))) if ratios else []
    if bases:  # none when only node layouts ran
        out += ["", "Node tokens/s ÷ baseline tokens/s (median of same-round ratios):", ""]
        out.append("| node | concurrent | " + " | ".join(f"÷ {b}" for b in bases) + " |")
        out.append("|---" * (len(bases) + 2) + "|")
        for n, per_base in ratios.items():
            for level in levels:
                row = [fmt(per_base[b][level], 2) for b in bases]
                out.append(f"| {n} | {level} | " + " | ".join(row) + " |")
    return "\n".join(out) + "\n"


FLASH_ATTN_WORDS = {
    "default": "each backend's default (node on, llama-cpp-python off, llama-server auto = on)",
    "on": "on in every backend",
    "off": "off in every backend",
}


def describe(details: dict[str, Any]) -> str:
    """One line on how a backend ran."""
    if "workers" in details:
        ws = [w for w in details["workers"] if str(w.get("worker_id", "")).startswith("llm")]
        parts = [
            f"{w['worker_id']}: {w['threads']} thread(s), {w.get('slots', 1)} slot(s), "
            f"cpus {w['cpus'] or 'inherited'}, nice {w.get('nice')}"
            for w in ws
        ]
        return "; ".join(parts) + f"; config `{json.dumps(details['config'])}`"
    if "argv" in details:
        argv = [Path(details["argv"][0]).name, *details["argv"][1:]]
        return f"`{' '.join(argv)}`"
    t = details["threads"]
    fa = details.get("flash_attn", "default")
    fa_arg = "" if fa == "default" else f", flash_attn={fa == 'on'}"
    return (
        f"`Llama(n_ctx={details['n_ctx']}, n_threads={t}, n_threads_batch={t}{fa_arg})`, "
        f"repack {'on' if details['repack'] else 'off'}, one request at a time"
    )
