"""``edgenode capacity``: print the memory plan, from the model or from sizes given by hand.

With ``--weights`` and ``--kv-per-seq`` it is the textbook calculation (no model
read, runtime 0): ``edgenode capacity --memory 8G --weights 4.2G --kv-per-seq
256M --reserve 1.5G`` leaves 2.3 GiB, so 9 sequences fit before the margin.
Without them it reads the configured model's GGUF metadata. ``--slots`` (an
integer or "auto", default ``workers.slots``) sets the sequences per worker; the
plan shows the resolved layout, workers x slots. Exit status 1 when the asked
workers do not fit (the plan is printed anyway), and with an error and no plan
for a config ``edgenode start`` refuses before it plans memory: a core plan it
cannot make (``node.cpus`` or ``workers.cpus`` outside the cores this process may
use, ``node.sandbox.cores.plan_workers``).
"""

from __future__ import annotations

import dataclasses
import functools
import json

import click

from broker.errors import EdgeNodeError
from node.capacity.budget import config_size, configured_budget
from node.capacity.gguf import ModelMeta
from node.capacity.plan import (
    AUTO_SLOTS_PER_THREAD,
    GRAMMAR_BYTES_PER_TOKEN,
    GRAMMAR_STATE_BYTES,
    KV_TYPES,
    Plan,
    advice,
    breakdown,
    bytes_per_element,
    config_plan,
    format_size,
    kv_cells,
    layout,
    plan_slots,
)
from node.capacity.worker_limits import describe, is_auto
from node.cli.context import add_global_options, config_path, wants_json
from node.config import MAX_SLOTS, NodeConfig, is_auto_slots, load_config
from node.engine import GRAMMAR_CHUNK
from node.sandbox.cores import plan_workers, worker_threads
from node.units import parse_size


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """Click callback: a size in binary units (``node.units``: 8G, 1.5G, 256M)."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise click.BadParameter(f"{exc} (binary units: 8G = 8 GiB)") from exc


def _slots(ctx: click.Context, param: click.Parameter, value: str | None) -> int | str | None:
    """Click callback: ``--slots``, an integer in [1, MAX_SLOTS] or "auto"."""
    if value is None or is_auto_slots(value):
        return value
    try:
        slots = int(value)
    except ValueError:
        slots = 0
    if not 1 <= slots <= MAX_SLOTS:
        raise click.BadParameter(f'an integer in [1, {MAX_SLOTS}] or "auto", got {value!r}')
    return slots


@click.command()
@click.option(
    "--memory",
    metavar="SIZE",
    callback=_size,
    help="Budget (default: the cgroup limit, else total RAM).",
)
@click.option(
    "--reserve",
    metavar="SIZE",
    callback=_size,
    help="Kept for the host (default: capacity.reserve).",
)
@click.option(
    "--weights", metavar="SIZE", callback=_size, help="Model weights, by hand (needs --kv-per-seq)."
)
@click.option(
    "--kv-per-seq", metavar="SIZE", callback=_size, help="KV cache of one sequence, by hand."
)
@click.option("--workers", type=click.IntRange(min=0), help="Workers (default: workers.count).")
@click.option(
    "--slots",
    metavar="N|auto",
    callback=_slots,
    help="Sequences per worker (default: workers.slots).",
)
@click.option("--n-ctx", type=click.IntRange(min=1), help="Context (default: model.n_ctx).")
@click.option("--kv-type", type=click.Choice(list(KV_TYPES)), help="Default: model.kv_type.")
@click.pass_context
def capacity(
    ctx: click.Context,
    memory: int | None,
    reserve: int | None,
    weights: int | None,
    kv_per_seq: int | None,
    workers: int | None,
    slots: int | str | None,
    n_ctx: int | None,
    kv_type: str | None,
) -> None:
    """How many sequences fit in memory: total = weights + W x (S x KV + runtime + grammar)
    for W workers of S slots."""
    if (weights is None) != (kv_per_seq is None):
        raise click.UsageError("--weights and --kv-per-seq go together (sizes by hand)")
    if weights is not None and (n_ctx is not None or kv_type is not None):
        raise click.UsageError("--n-ctx and --kv-type apply to the model, not to sizes by hand")
    try:
        config = load_config(config_path(ctx))
        plan_workers(config.workers, config.node.cpus)  # the cores start checks
        if weights is not None and kv_per_seq is not None:
            sizes = (weights, kv_per_seq)
            plan, meta = _manual(config, memory, reserve, sizes, workers, slots), None
        else:
            plan, meta = config_plan(
                config,
                budget=memory,
                reserve=reserve,
                workers=workers,
                slots=slots,
                n_ctx=n_ctx,
                kv_type=kv_type,
            )
    except EdgeNodeError as exc:
        raise click.ClickException(exc.message) from exc
    if wants_json(ctx):
        tips = [] if plan.fits else advice(plan, meta)
        data = plan.as_dict() | {"advice": tips, "worker_limits": describe(config.workers, plan)}
        click.echo(json.dumps(data, indent=2, sort_keys=True))
    else:
        click.echo(render(plan, meta, config, config.workers.slots if slots is None else slots))
    if not plan.fits:
        ctx.exit(1)


def _manual(
    config: NodeConfig,
    memory: int | None,
    reserve: int | None,
    sizes: tuple[int, int],
    workers: int | None,
    slots: int | str | None,
) -> Plan:
    """The textbook plan: sizes by hand (weights, KV per sequence), weights shared, no
    runtime overhead; "auto" slots as ``node.capacity.plan.resolve_slots`` sizes them."""
    budget, source = (memory, "given") if memory is not None else configured_budget(config)
    if reserve is None:
        reserve = config_size(config.capacity.reserve, "capacity.reserve")
    count = config.workers.count if workers is None else workers
    weights, kv_per_seq = sizes
    by_hand = functools.partial(
        Plan,
        budget=budget,
        reserve=reserve,
        weights=weights,
        kv_per_seq=kv_per_seq,
        workers=count,
        margin=config.capacity.safety_margin,
        budget_source=source,
    )
    asked = config.workers.slots if slots is None else slots
    return plan_slots(lambda s: by_hand(slots=s), asked, worker_threads(config.workers, count))


def render(
    plan: Plan, meta: ModelMeta | None, config: NodeConfig, slots: int | str | None = None
) -> str:
    """The plan as an operator reads it: formula with numbers, budget, layout (workers x
    slots; ``slots`` is the setting, an int or "auto", default ``workers.slots``), fit,
    limits, knobs."""
    s = format_size
    lines = _model_lines(plan, meta) if meta else [f"sizes by hand ({plan.model or 'no model'})"]
    sharing = "shared (mmapped, counted once)" if plan.weights_shared else "private copy per worker"
    lines += [
        f"weights     {s(plan.weights)}, {sharing}",
        f"budget      {s(plan.budget)} ({plan.budget_source}) - reserve {s(plan.reserve)}"
        f" - shared weights {s(plan.shared_weights)} = {s(plan.left)} left",
        f"layout      {layout(plan)} ({slots_setting(config, slots, plan.workers)})",
        f"per worker  {breakdown(plan)} = {s(plan.per_worker)}",
        f"total       weights {s(plan.shared_weights)} + {plan.workers} x {s(plan.per_worker)}"
        f" = {s(plan.total)} for {layout(plan)}",
        f"fits        {layout(dataclasses.replace(plan, workers=plan.fits_before_margin))}"
        f" before the margin ({s(plan.left)} / {s(plan.per_worker)}"
        f" = {max(plan.left, 0) / plan.per_worker:.1f})",
        f"            {layout(dataclasses.replace(plan, workers=plan.fits_safe))}"
        f" with the {plan.margin:.0%} safety margin ({s(plan.left)} / {s(plan.memory_max)}"
        " per worker)",
        f"limits      per worker: memory.high = {s(plan.memory_high)},"
        f" memory.max = {s(plan.memory_max)}"
        f" (estimate + {plan.margin / 2:.0%} / + {plan.margin:.0%})",
    ]
    lines.append(workers_line(config, plan))
    each = "" if plan.slots == 1 else f" (of {plan.slots} slots each)"
    if plan.fits:
        lines.append(f"verdict     OK: {plan.workers} worker(s) asked, {plan.fits_safe} fit{each}")
    else:
        lines.append(
            f"verdict     DOES NOT FIT: {plan.workers} worker(s) asked, {plan.fits_safe} fit{each}"
        )
        lines += [f"  turn a knob: {tip}" for tip in advice(plan, meta)]
    return "\n".join(lines)


def slots_setting(
    config: NodeConfig, slots: int | str | None = None, workers: int | None = None
) -> str:
    """Where the slots come from: ``workers.slots = 4``, or for "auto" how it was sized
    for ``workers`` workers (default ``workers.count``): per thread each really runs."""
    slots = config.workers.slots if slots is None else slots
    if not is_auto_slots(slots):
        return f"workers.slots = {slots}"
    threads = worker_threads(config.workers, workers)
    return (
        f'workers.slots = "auto": the most that fit, at most {AUTO_SLOTS_PER_THREAD} per thread'
        f" x {threads} thread(s)"
    )


def workers_line(config: NodeConfig, plan: Plan) -> str:
    """The limits ``edgenode start`` gives each model worker's cgroup with this plan."""
    limits = describe(config.workers, plan)
    setting = f'workers.memory_max = "{limits["setting"]}"'
    if is_auto(config.workers):
        setting += ": the plan's limits"
    top, high = limits["memory_max"], limits["memory_high"]
    caps = [
        "no memory.max" if top is None else f"memory.max = {format_size(int(top))}",
        "no memory.high" if high is None else f"memory.high = {format_size(int(high))}",
    ]
    return f"workers     {', '.join(caps)} per worker at start ({setting})"


def _model_lines(plan: Plan, meta: ModelMeta) -> list[str]:
    s = format_size
    kinds = set(meta.n_head_kv)
    heads = (
        f"{meta.n_layer} layers x {kinds.pop()} KV head(s)"
        if len(kinds) == 1
        else f"{sum(meta.n_head_kv)} KV heads over {meta.n_layer} layers"
    )
    b = float(bytes_per_element(plan.kv_type))
    return [
        f"model       {meta.name} ({meta.path})",
        f"KV/token    {heads} x ({meta.key_length} + {meta.value_length}) x {b:g} B"
        f" ({plan.kv_type}) = {plan.kv_per_token:,} B",
        f"KV/seq      {plan.kv_per_token:,} B x {kv_cells(plan.n_ctx)} cells"
        f" (n_ctx {plan.n_ctx}, padded to 256) = {s(plan.kv_per_seq)}",
        f"runtime     {s(plan.runtime_overhead)} overhead + {s(plan.scratch)} attention scratch"
        f"{' (flash attention)' if plan.flash_attn else ''}"
        + (
            f" + {plan.slots - 1} x {s(plan.slot_runtime)} per further slot (logits row and"
            " sampler candidates)"
            if plan.slots > 1 and plan.slot_runtime
            else ""
        )
        + f" = {s(plan.runtime_per_worker)} per worker",
        f"grammar     {min(plan.n_vocab, GRAMMAR_CHUNK):,} candidate tokens x"
        f" {GRAMMAR_BYTES_PER_TOKEN} B + {plan.slots} x {s(GRAMMAR_STATE_BYTES)}"
        f" = {s(plan.grammar)} per worker (json_schema sampling: the vocabulary is"
        " checked in pieces, one slot at a time; each slot's grammar)",
    ]


# The global options also when the command runs on its own (tests, embedding);
# the edgenode group adds none twice (node.cli.context.add_global_options).
add_global_options(capacity)
