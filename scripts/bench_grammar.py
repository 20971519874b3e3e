#!/usr/bin/env python3
"""A worker's memory peak under JSON-schema requests, against the plan (a benchmark, not a test).

For each case, starts a fresh real node (``edgenode start --foreground``: the
llama engine, the default model, one worker, ``workers.sandbox = "required"`` so
the worker has its own memory cgroup), sends ONE request, reads the worker's
cgroup peak (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``: what
``memory.max`` is compared with, so what OOM-kills) and its ``/proc/<pid>/smaps``
private memory afterwards, and compares them with the plan of ``node.capacity.plan``.

Every request's prompt fills the context (``--fill``, the default: the KV cache
and the attention scratch fully touched, as in ``scripts/bench_memory.py``)
before the model generates ``--max-tokens`` tokens, so a case's peak is the
worst case of one request. Cases:

* ``plain``: no schema, the baseline;
* ``intent``: ``fallback.intents.INTENT_SCHEMA``, a realistic schema;
* ``obj<N>``: N nested objects, each with a required string (``name``) and the
  next level (``child``); ``arr<N>``: N nested arrays of strings (``minItems`` 1);
* ``str<N>``: a string of ``maxLength`` N; ``wide<N>``: N required string
  properties;
* the largest schemas ``node.llama.grammar`` admits (``*-max``) and one step beyond
  each bound (``*-over``), which must get 413 without the worker noticing.

Each case gets a fresh node, so one case's heap never carries into the next.
``grammar extra`` is the case's peak minus the plain case's; the plan's
``grammar`` allowance (``node.capacity.plan.grammar_allowance``) must cover it, and
``memory.max`` the whole peak.

With ``--slots S`` the worker has S slots and each case sends S such requests
at once: the plan holds one filter call's candidates per worker (a worker
samples its slots one after another) and one grammar per slot
(``node.capacity.plan.grammar_allowance``).

Usage: ``python scripts/bench_grammar.py [--cases plain,intent,obj1,...] [--n-ctx 2048] [--slots 1]
[--max-tokens 48] [--no-fill] [--memory-max 1G]``. Needs root and cgroups (v1,
hybrid or v2 with a writable memory controller).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from broker.errors import EdgeNodeError
from fallback.intents import INTENT_SCHEMA
from node.bench.context import list_type
from node.capacity.plan import Plan, config_plan
from node.config import load_config
from node.sandbox.cgroupfs import read_int
from node.testing import NodeProcess
from node.units import format_size

MiB = 1 << 20


def nested_objects(levels: int) -> dict[str, Any]:
    """``levels`` objects inside each other, each with a required short string to
    fill (at most 4 characters, so generation reaches the innermost level)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 4}, "child": schema},
            "required": ["name", "child"],
        }
    return schema


def nested_arrays(levels: int) -> dict[str, Any]:
    """``levels`` arrays inside each other around strings, none empty."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema, "minItems": 1}
    return schema


def long_string(max_length: int) -> dict[str, Any]:
    """An object with one string of at most ``max_length`` characters."""
    text = {"type": "string", "maxLength": max_length}
    return {"type": "object", "properties": {"text": text}, "required": ["text"]}


def wide_object(n: int) -> dict[str, Any]:
    """An object with ``n`` required string properties."""
    names = [f"field_{i}" for i in range(n)]
    return {
        "type": "object",
        "properties": {k: {"type": "string"} for k in names},
        "required": names,
    }


def cases() -> dict[str, dict[str, Any] | None]:
    """Every case by name (None = no schema). Nested cases need more tokens to reach
    their innermost level than ``--max-tokens`` may give: see ``tokens_for``."""
    from node.llama.grammar import MAX_REPEAT, MAX_SCHEMA_DEPTH

    # Each object level is two maps deep (the object, its "properties"); the
    # innermost string one more. Arrays are one map per level.
    obj_max = (MAX_SCHEMA_DEPTH - 1) // 2
    out: dict[str, dict[str, Any] | None] = {"plain": None, "intent": INTENT_SCHEMA}
    for n in (1, 2, 4, 8):
        out[f"obj{n}"] = nested_objects(n)
        out[f"arr{n}"] = nested_arrays(n)
    out |= {
        "obj-max": nested_objects(obj_max),
        "obj-over": nested_objects(obj_max + 1),
        "arr-max": nested_arrays(MAX_SCHEMA_DEPTH - 1),
        "arr-over": nested_arrays(MAX_SCHEMA_DEPTH),
        "str64": long_string(64),
        "str-max": long_string(MAX_REPEAT),
        "str-over": long_string(MAX_REPEAT + 1),
        "wide16": wide_object(16),
        "wide-max": wide_object(_widest()),
        "wide-over": wide_object(_widest() + 1),
    }
    return out


def tokens_for(name: str, asked: int) -> int:
    """Tokens to generate for a case: enough to reach a nested case's innermost level
    (about 10 per object level, ``{"name":"abcd","child":``; 2 per array level)."""
    from node.llama.grammar import MAX_SCHEMA_DEPTH

    levels = {"obj-max": (MAX_SCHEMA_DEPTH - 1) // 2, "arr-max": MAX_SCHEMA_DEPTH - 1}
    for kind, per_level in (("obj", 10), ("arr", 2)):
        digits = name.removeprefix(kind)
        if name.startswith(kind) and (digits.isdigit() or name in levels):
            n = int(digits) if digits.isdigit() else levels[name]
            return max(asked, per_level * n + 24)
    return asked


def _widest() -> int:
    """The most required string properties ``node.llama.grammar`` admits (schema and grammar)."""
    from broker.errors import TooLarge
    from node.llama.grammar import schema_grammar

    def admitted(n: int) -> bool:
        try:
            schema_grammar(wide_object(n))
        except TooLarge:
            return False
        return True

    n = 1
    while admitted(n + 1):
        n += 1
    return n


def grammar_bytes(schema: dict[str, Any] | None) -> int:
    """Bytes of the GBNF grammar a worker makes of ``schema`` (0 without one, or
    for a schema over a bound: the worker refuses it before making a grammar)."""
    from node.llama.grammar import schema_grammar

    if schema is None:
        return 0
    try:
        return len(schema_grammar(schema))
    except EdgeNodeError:
        return 0


def private_bytes(pid: int) -> int:
    """Private memory (``Private_Clean`` + ``Private_Dirty``) of ``pid``, from smaps."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as fh:
        for line in fh:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1]) * 1024
    return total


def cgroup_peak(cgroup: Path) -> int | None:
    """The cgroup's peak usage since it was made (the worker's whole life here)."""
    return read_int(cgroup / "memory.max_usage_in_bytes") or read_int(cgroup / "memory.peak")


def run_case(name: str, schema: dict[str, Any] | None, args: argparse.Namespace) -> dict[str, Any]:
    """One fresh node, one request per slot at once (all with the case's schema);
    the plan and what the worker's cgroup saw."""
    node = NodeProcess(
        {
            "workers": {
                "engine": "llama",
                "count": 1,
                "slots": args.slots,
                "threads": 1,
                "sandbox": "required",
                "memory_max": args.memory_max,
            },
            "model": {"n_ctx": args.n_ctx},
            "broker": {"stall_timeout_ms": 60_000, "max_timeout_ms": 600_000},
            "breaker": {"slow_call_ms": 600_000},
            "fallback": {"rules": ""},
        }
    )
    try:
        node.start(timeout=args.timeout)
        plan, _ = config_plan(load_config(str(node.config)))
        worker = node.status()["processes"][0]
        tokens = tokens_for(name, args.max_tokens)
        words = args.n_ctx - tokens - 96 if args.fill else 8
        prompt = "robot " * words + "\nAnswer in JSON:"  # one token per word
        fields: dict[str, Any] = {"max_tokens": tokens, "temperature": 0.0}
        fields |= {"route": "llm", "timeout_ms": 600_000}
        if schema is not None:
            fields["json_schema"] = schema
        start = time.monotonic()
        outcomes: list[dict[str, Any]] = []

        def one(i: int) -> None:
            try:
                with node.client(wait_ms=600_000) as client:
                    reply = client.generate(f"{i} {prompt}", **fields)
                done = {"code": 200, "tokens": reply.usage.get("completion_tokens", 0)}
                done |= {"text": reply.text, "ttft_s": reply.ttft_ms / 1000}
            except EdgeNodeError as exc:
                done = {"code": int(exc.code), "tokens": 0, "text": exc.message, "ttft_s": 0.0}
            outcomes.append(done)

        clients = [threading.Thread(target=one, args=(i,)) for i in range(args.slots)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join()
        outcome = min(outcomes, key=lambda o: (o["code"] == 200, o["tokens"]))  # the worst
        took = time.monotonic() - start
        time.sleep(0.3)
        after = node.status()["processes"][0]
        return {
            "plan": plan,
            "outcome": outcome,
            "seconds": took,
            "peak": cgroup_peak(Path(worker["cgroup"])),
            "private": private_bytes(worker["pid"]),
            "same_pid": after["pid"] == worker["pid"],
            "oom_kills": after["oom_kills"],
            "grammar_bytes": grammar_bytes(schema),
            "schema_bytes": 0 if schema is None else len(json.dumps(schema, separators=(",", ":"))),
        }
    finally:
        node.cleanup()


def report(results: dict[str, dict[str, Any]]) -> None:
    """The table: outcome, sizes, peak and the plan's numbers."""
    plan: Plan = next(iter(results.values()))["plan"]
    allowance = getattr(plan, "grammar", 0)
    print(
        f"\nplan: per worker {format_size(plan.per_worker)} (grammar allowance "
        f"{format_size(allowance)}), memory.max {format_size(plan.memory_max)}, "
        f"memory.high {format_size(plan.memory_high)}"
    )
    plain = results.get("plain", {}).get("peak")
    print(
        f"{'case':<10} {'schema':>7} {'GBNF':>7} {'code':>4} {'tok':>4} {'s':>6} {'ms/tok':>6} "
        f"{'peak':>9} {'extra':>8} {'/allow':>7} {'/max':>6} {'private':>9} {'OOM':>3}"
    )
    for name, r in results.items():
        peak = r["peak"] or 0
        extra = peak - plain if plain is not None and name != "plain" else None
        ratio = f"{extra / allowance:.2f}" if extra is not None and allowance else "-"
        oom = r["oom_kills"] if r["same_pid"] else f"{r['oom_kills']}!"
        out = r["outcome"]
        per_token = (r["seconds"] - out["ttft_s"]) / out["tokens"] * 1000 if out["tokens"] else 0
        print(
            f"{name:<10} {r['schema_bytes']:>7} {r['grammar_bytes']:>7} "
            f"{out['code']:>4} {out['tokens']:>4} {r['seconds']:>6.1f} {per_token:>6.0f} "
            f"{peak / MiB:>8.1f}M {'-' if extra is None else f'{extra / MiB:+.1f}M':>8} "
            f"{ratio:>7} {peak / plan.memory_max:>6.2f} {r['private'] / MiB:>8.1f}M {oom:>3}"
        )
        if r["outcome"]["code"] != 200:
            print(f"{'':<10} -> {r['outcome']['text'][:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", type=list_type("case", str), help="comma-separated case names (default: all)"
    )
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument(
        "--slots", type=int, default=1, help="slots of the worker: that many requests at once"
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--no-fill", dest="fill", action="store_false", help="short prompts")
    parser.add_argument("--memory-max", default="1G", help="workers.memory_max while measuring")
    parser.add_argument("--timeout", type=float, default=240.0, help="node start timeout (s)")
    args = parser.parse_args()
    every = cases()
    names: list[str] = args.cases or list(every)
    unknown = [n for n in names if n not in every]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; known: {', '.join(every)}")
    print(
        f"host: {psutil.cpu_count()} CPUs, {format_size(psutil.virtual_memory().total)} RAM; "
        f"n_ctx {args.n_ctx}, {args.max_tokens} tokens, fill={args.fill}"
    )
    results = {}
    for name in names:
        results[name] = run_case(name, every[name], args)
        r = results[name]
        print(
            f"  {name}: code {r['outcome']['code']}, peak {format_size(r['peak'] or 0)}, "
            f"{r['seconds']:.1f} s, text {r['outcome']['text'][:60]!r}",
            flush=True,
        )
    report(results)


if __name__ == "__main__":
    main()
