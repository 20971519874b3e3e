"""The human view of ``edgenode status`` (the ``--json`` view is the raw map)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from node.sandbox.cores import cores_line, format_cpus
from node.service.health import judge
from node.units import format_size

if TYPE_CHECKING:
    from node.pool import WorkerStatus


def render_status(node: dict[str, Any]) -> str:
    """Header lines (node, state, gate, breaker, sandbox), the worker table, counters.
    The state line is ``node.service.health``'s (what ``status --ready`` and
    systemd's STATUS= say)."""
    routing = node.get("routing", {})
    lines = [
        f"edgenode pid {node.get('pid')}  model {Path(str(node.get('model'))).name}  "
        f"engine {node.get('engine')}  mode {routing.get('mode', '-')}",
        f"frontend {node.get('endpoints', {}).get('frontend')}",
        f"state: {judge(node).line}",
        _security_line(node.get("security"), node.get("refused"), node.get("allowed_keys")),
        _gate_line(node),
        _breaker_line(routing.get("breaker")),
        _sandbox_line(node.get("sandbox")),
        _cores_line(node.get("cores")),
        _capacity_line(node.get("capacity"), node.get("memory", {})),
        "",
        f"{'WORKER':<8} {'STATE':<10} {'PID':>7} {'CREDIT':>6} {'RESTARTS':>8} {'CORES':>5} "
        f"{'THR':>3} {'NICE':>5} {'MEM/LIMIT':>13} {'PEAK':>7} {'OOM':>3}  LAST EXIT",
    ]
    registered = {w["worker_id"]: w for w in node.get("workers", [])}
    processes: list[WorkerStatus] = node.get("processes", [])
    for proc in processes:
        lines.append(_worker_line(proc, registered.get(proc["worker_id"])))
    remote = [w for w in node.get("workers", []) if w.get("remote")]
    if remote:
        lines += ["", *_remote_lines(remote)]
    counters = node.get("counters", {})
    outcomes = {k: v for k, v in counters.items() if k not in DELIVERY_COUNTERS}
    if outcomes:
        lines += ["", "requests: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items()))]
    if any(k in counters for k in DELIVERY_COUNTERS) or node.get("delivery", {}).get("backlog"):
        lines.append(_replies_line(counters, node.get("delivery", {})))
    if node.get("service"):
        lines.append(_service_line(node["service"]))
    return "\n".join(line for line in lines if line is not None)


def _security_line(
    security: dict[str, str] | None,
    refused: dict[str, Any] | None,
    allowed: dict[str, int] | None = None,
) -> str | None:
    """``security: frontend curve (refused 2 keys, 5 handshakes), backend plaintext``;
    a CURVE frontend whose allowlist is empty (``allowed`` 0; a node before this
    count says nothing) adds ``no client key allowed: only this host``. None from
    a node without ``[security]`` in its status."""
    if not security:
        return None
    parts = []
    for side in ("frontend", "backend"):
        text = f"{side} {security.get(side, '-')}"
        counts = (refused or {}).get(side, {})
        keys, shakes = counts.get("key_not_allowed", 0), counts.get("handshake_failed", 0)
        notes = []
        if side == "frontend" and (allowed or {}).get(side) == 0:
            notes.append("no client key allowed: only this host")
        if keys or shakes:
            notes.append(f"refused {keys} keys, {shakes} handshakes")
        if notes:
            text += f" ({'; '.join(notes)})"
        parts.append(text)
    return "security: " + ", ".join(parts)


def _remote_lines(workers: list[dict[str, Any]]) -> list[str]:
    """The registered workers that remote host agents run (``edgenode worker``):
    the node does not supervise them, so they have no row among its processes."""
    lines = [
        f"{'REMOTE WORKER':<20} {'HOST':<12} {'STATE':<6} {'PID':>7} {'CREDIT':>6} "
        f"{'CORES':>5} {'THR':>3} {'SEEN':>7}"
    ]
    for w in sorted(workers, key=lambda w: str(w.get("worker_id"))):
        cpus = w.get("cpus")
        lines.append(
            f"{w.get('worker_id')!s:<20} {w.get('host')!s:<12} {w.get('state')!s:<6} "
            f"{w.get('pid', '-')!s:>7} {str(w.get('credit')) + '/' + str(w.get('slots')):>6} "
            f"{format_cpus(cpus) if isinstance(cpus, list) and cpus else '-':>5} "
            f"{_threads(w.get('threads'), w):>3} "
            f"{str(w.get('last_seen_ms')) + 'ms':>7}"
        )
    return lines


#: The counters of what became of the messages sent to clients (broker.delivery),
#: shown on their own line rather than among the requests' outcomes.
DELIVERY_COUNTERS = (
    "finals_delivered",
    "finals_backlogged",
    "finals_undeliverable",
    "partials_delivered",
    "partials_dropped",
    "backlog_overflows",
)


def _replies_line(counters: dict[str, int], delivery: dict[str, Any]) -> str:
    """What became of the replies sent to clients, and what waits for slow readers.
    Finals are every op's (PROTOCOL §12.1): each ``status`` and ``ping`` answered
    counts one, so the line says so (a user polling ``status`` saw them grow)."""
    n = {k: counters.get(k, 0) for k in DELIVERY_COUNTERS}
    return (
        f"replies: finals {n['finals_delivered']} delivered (every op's, status included), "
        f"{n['finals_backlogged']} waited, "
        f"{n['finals_undeliverable']} undeliverable; partials {n['partials_delivered']} "
        f"delivered, {n['partials_dropped']} dropped; waiting now {delivery.get('backlog', 0)} "
        f"for {delivery.get('backlog_clients', 0)} client(s) (max "
        f"{delivery.get('max_backlog', '-')} each), {n['backlog_overflows']} overflowed"
    )


def _gate_line(node: dict[str, Any]) -> str:
    memory = node.get("memory", {})
    pressure = node.get("pressure", "ok")
    if memory.get("budget"):
        source = f"; {memory['budget_source']}" if memory.get("budget_source") else ""
        pressure += (
            f" (working set {_size(memory.get('working_set'))} of "
            f"{_size(memory['budget'])}, {memory.get('used_pct')}%{source})"
        )
    return (
        f"gate: queue {node['queue_depth']}/{node['queue_bound']}  in-flight "
        f"{node['in_flight']}  free credit {node['credit']} (model credit usable now "
        f"{node.get('credit_limit', '-')})  memory pressure {pressure}  "
        f"cpu pressure {_cpu(node)}"
    )


def _cpu(node: dict[str, Any]) -> str:
    """The host's CPU pressure level and the PSI reading behind it, or why it is not read."""
    cpu = node.get("cpu") or {}
    level = node.get("cpu_pressure", cpu.get("level", "-"))
    if not cpu:
        return str(level)  # an older node
    if cpu.get("source") is None:
        return f"{level} (not measured: {cpu.get('reason') or 'no PSI file'})"
    avg10 = cpu.get("some_avg10")
    reading = "-" if avg10 is None else f"{avg10:g}%"
    return (
        f"{level} (some avg10 {reading} of {cpu['source']}; high at {cpu.get('warn_pct'):g}%, "
        f"ok below {cpu.get('clear_pct'):g}%)"
    )


def _breaker_line(breaker: dict[str, Any] | None) -> str:
    if not breaker:
        return "breaker: -"
    rates = []
    for key, label in (("failure_rate_pct", "failures"), ("slow_call_rate_pct", "slow")):
        value = breaker.get(key)
        if value is not None:
            rates.append(f"{label} {value:.0f}%")
    calls = breaker.get("calls", "?")
    return f"breaker: {breaker.get('state')} ({', '.join(rates) or 'no rate yet'}, {calls} calls)"


def _sandbox_line(sandbox: dict[str, Any] | None) -> str:
    if not sandbox:
        return "sandbox: -"
    if not sandbox.get("cgroup"):
        return f"sandbox: off ({sandbox.get('reason') or sandbox.get('mode')})"
    return f"sandbox: {sandbox.get('backend')} ({sandbox.get('layout')}) {sandbox['cgroup']}"


def _cores_line(cores: dict[str, Any] | None) -> str | None:
    """``node.sandbox.cores.cores_line`` of the node's plan; nothing from an older node."""
    return cores_line(cores) if cores else None


def _capacity_line(plan: dict[str, Any] | None, memory: dict[str, Any]) -> str | None:
    if not plan:
        return None
    measured = memory.get("working_set")
    grammar = f", {_size(plan['grammar'])} of it for a json_schema" if plan.get("grammar") else ""
    limits = plan.get("worker_limits") or {}
    planned = f" (plan's memory.max {_size(plan.get('memory_max'))})"
    applied = ""
    if limits:
        top = "none" if limits.get("memory_max") is None else _size(limits["memory_max"])
        applied = f'; workers get memory.max {top} (workers.memory_max = "{limits["setting"]}")'
        if limits.get("memory_max") == plan.get("memory_max"):
            planned = ""  # "auto": the same number twice
    return (
        f"capacity plan: {_layout(plan)}{_size(plan.get('per_worker'))} per worker{grammar}"
        f"{planned}{applied}, {_size(plan.get('total'))} in all of {_size(plan.get('budget'))}"
        f"{_stale(plan, memory)}; measured working set {_size(measured)}"
    )


def _stale(plan: dict[str, Any], memory: dict[str, Any]) -> str:
    """What the plan, made at start, misses when the live budget (the pressure
    poll's reading: a parent's limit lowered since counts within 2 s) is a cgroup
    limit below the budget it was made for: `` at start; the budget is now 1 GiB:
    DOES NOT FIT``. Not for the pressure budget the node computes without one (its
    workers' limits plus its share: smaller than the machine's, never lowered)."""
    budget, total, now = plan.get("budget"), plan.get("total"), memory.get("budget")
    if memory.get("budget_kind") == "node":
        return ""
    if not isinstance(now, int) or not isinstance(budget, int) or now >= budget:
        return ""
    fits = isinstance(total, int) and total <= now
    return f" at start; the budget is now {_size(now)}: {'fits' if fits else 'DOES NOT FIT'}"


def _layout(plan: dict[str, Any]) -> str:
    """``2 workers x 4 slots = 8 sequences, `` from the plan (nothing from an older node)."""
    workers, slots = plan.get("workers"), plan.get("slots")
    if not isinstance(workers, int) or not isinstance(slots, int):
        return ""
    return (
        f"{workers} worker{'s' * (workers != 1)} x {slots} slot{'s' * (slots != 1)}"
        f" = {workers * slots} sequence{'s' * (workers * slots != 1)}, "
    )


def _service_line(service: dict[str, dict[str, Any]]) -> str:
    """What admission predicts from: per engine kind the mean service time (of
    plain requests; ``json_schema`` ones' apart, once measured) and, once learned,
    the prefill and decode rates (broker.service_time)."""
    parts = []
    for kind, s in service.items():
        rates = ""
        if s.get("decode_ms_per_token") is not None:
            rates = (
                f"; prefill {s['prefill_ms_per_token']:g} ms/token,"
                f" decode {s['decode_ms_per_token']:g} ms/token"
            )
        schema = s.get("json_schema")
        if schema is not None:  # grammar-bound requests: a mean of their own
            rates += f"; json_schema mean {schema['mean_ms']:g} ms, {schema['samples']} served"
        parts.append(f"{kind} mean {s['mean_ms']:g} ms ({s['samples']} served{rates})")
    return "service: " + ", ".join(parts)


def _worker_line(proc: WorkerStatus, reg: dict[str, Any] | None) -> str:
    state = reg["state"] if reg and proc["state"] == "ready" else proc["state"]
    credit = f"{reg['credit']}/{reg['slots']}" if reg else "-"
    memory = proc.get("memory") or {}
    used = f"{_size(memory.get('current'))}/{_size(memory.get('limit'))}" if memory else "-"
    # Planned cores, else the affinity the worker reported in READY (a node started
    # under taskset pins nothing yet runs its workers on fewer cores than the host's).
    cpus = format_cpus(proc.get("cpus") or (reg or {}).get("cpus") or []) or "all"
    return (
        f"{proc['worker_id']:<8} {state:<10} {proc['pid'] or '-':>7} {credit:>6} "
        f"{proc['restarts']:>8} {cpus:>5} {_threads(proc.get('threads'), reg):>3} {_nice(proc):>5} "
        f"{used:>13} {_size(memory.get('peak')):>7} {proc.get('oom_kills', 0):>3}  "
        f"{_last_column(proc)}"
    )


def _threads(configured: Any, reg: dict[str, Any] | None) -> str:
    """THR: the configured threads; ``1/2`` while the worker computes on fewer (its
    last HEARTBEAT's ``compute_threads``: a starved llama worker drops to one)."""
    now = (reg or {}).get("compute_threads")
    if configured is None:
        return "-"
    return f"{now}/{configured}" if now is not None and now != configured else str(configured)


def _last_column(proc: WorkerStatus) -> str:
    """The last exit; for a loading worker first its progress (``loading``:
    ``loading 12.3s CPU, 310 MiB in 45s, progress 0.2s ago``)."""
    last = proc["last_exit"] or "-"
    loading = proc.get("loading")
    if not loading:
        return last
    progress = (
        f"loading {loading['cpu_s']:.1f}s CPU, {format_size(loading['rss_bytes'])} in "
        f"{loading['loading_ms'] / 1000:.0f}s, progress {loading['idle_ms'] / 1000:.1f}s ago"
    )
    return progress if last == "-" else f"{progress}; {last}"


def _nice(proc: WorkerStatus) -> str:
    """The nice level; "10/0" when the worker's autogroup, which is what ranks it
    against the host's sessions, has another (node.sandbox.niceness)."""
    nice, group = proc.get("nice"), proc.get("autogroup_nice")
    if nice is None:
        return "-"
    return str(nice) if group is None or group == nice else f"{nice}/{group}"


def _size(value: Any) -> str:
    return format_size(value) if isinstance(value, int) else "-"
