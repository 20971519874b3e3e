"""``edgenode status --watch``: the one-screen status view, refreshed, with rates.

Rates are counter deltas between two refreshes over the time between them
(measured here, monotonic): requests admitted, answered ok, shed (every
``shed_*``), ended in error (deadline, worker lost, bad request, client gone)
and answered by the rules as a fallback (every ``fallback_*``), per second. The
node's ``status`` carries counters, not latency samples or token counts, so the
view shows no TTFT/e2e percentiles and no tokens/s (it says so instead of
inventing them). A
counter that went down (the node restarted: another pid) starts the rates over.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TextIO

#: ANSI: cursor home, clear the screen; and hide/show the cursor.
CLEAR = "\x1b[H\x1b[2J"
HIDE_CURSOR = "\x1b[?25l"
SHOW_CURSOR = "\x1b[?25h"
#: Counters (``broker.stats``) summed into each rate, by name or by prefix.
RATES: dict[str, tuple[str, ...]] = {
    "admitted": ("admitted",),
    "ok": ("ok",),
    "shed": ("shed_",),
    "errors": ("deadline_exceeded", "worker_lost", "rejected_bad_request", "client_gone"),
    "fallback": ("fallback_",),
}


@dataclass(frozen=True)
class Sample:
    """One refresh: the node's ``pid``, its ``counters``, and when (monotonic s)."""

    pid: Any
    counters: Mapping[str, int]
    at: float


def _total(counters: Mapping[str, int], names: tuple[str, ...]) -> int:
    return sum(
        v
        for k, v in counters.items()
        if any(k == n or (n.endswith("_") and k.startswith(n)) for n in names)
    )


def rates(prev: Sample | None, cur: Sample) -> dict[str, float] | None:
    """Per-second rates of ``RATES`` between two samples; None for the first
    refresh, after a restart (another pid, or a counter went down) or when no
    time passed."""
    if prev is None or prev.pid != cur.pid or cur.at <= prev.at:
        return None
    if any(cur.counters.get(k, 0) < v for k, v in prev.counters.items()):
        return None
    span = cur.at - prev.at
    return {
        name: (_total(cur.counters, names) - _total(prev.counters, names)) / span
        for name, names in RATES.items()
    }


def rates_line(r: dict[str, float] | None, span_s: float) -> str:
    """The rates as one line (req/s), or why there are none yet."""
    if r is None:
        return f"rates: - (from the next refresh, over {span_s:g} s)"
    parts = ", ".join(f"{name} {value:.1f}" for name, value in r.items())
    return (
        f"rates over the last {span_s:.1f} s (req/s): {parts}\n"
        "tokens/s, TTFT and e2e p50/p99: - (status carries no token counts or latency samples)"
    )


def watch(
    fetch: Callable[[], dict[str, Any] | None],
    render: Callable[[dict[str, Any]], str],
    interval_s: float,
    count: int | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> bool:
    """Show ``render(status)`` and the rates every ``interval_s`` seconds.

    Clears the screen between views on a terminal; elsewhere (a pipe, a log)
    each view follows the last under a header. ``as_json``: one JSON line per
    refresh, the status map with ``rates`` added. Returns after ``count``
    refreshes (None: until Ctrl-C) with True, or with False as soon as
    ``fetch`` returns None (no node answers: it stopped). Ctrl-C ends it
    cleanly (True), the cursor shown again.
    """
    stream = out if out is not None else sys.stdout
    tty = stream.isatty() and not as_json
    prev: Sample | None = None
    shown = 0
    if tty:
        stream.write(HIDE_CURSOR)
    try:
        while count is None or shown < count:
            status = fetch()
            if status is None:
                stream.write("edgenode is not answering (stopped?)\n")
                return False
            cur = Sample(status.get("pid"), dict(status.get("counters") or {}), clock())
            r = rates(prev, cur)
            span = interval_s if prev is None else cur.at - prev.at
            if as_json:
                stream.write(json.dumps({**status, "rates": r}, sort_keys=True) + "\n")
            else:
                head = CLEAR if tty else f"--- {time.strftime('%H:%M:%S')} ---\n"
                stream.write(f"{head}{render(status)}\n{rates_line(r, span)}\n")
            stream.flush()
            prev = cur
            shown += 1
            if count is None or shown < count:
                time.sleep(interval_s)
        return True
    except KeyboardInterrupt:
        stream.write("\n")
        return True
    finally:
        if tty:
            stream.write(SHOW_CURSOR)
        stream.flush()
