"""An app that embeds a node, for tests/integration/test_embed.py.

``python tests/embed_app.py CONFIG REPORT MODE`` (``PYTHONPATH`` = the repo): installs
its own SIGTERM/SIGINT handlers, embeds a node from ``CONFIG`` with ``with
Node(config)`` and the sync Client (MODE ``sync``, ``raise``, ``rules``, ``timeout``;
``forget``: ``start`` without ``stop``; ``two``: a second node, of the config in
``$EDGENODE_CONFIG2``, in the same process; ``hold``: serve until a line comes on
stdin; ``ctrlc``: Python's default SIGINT handler, a slow request in flight, serve
until a Ctrl-C) or ``async with Node(config)`` and the
AsyncClient (MODE ``async``), serves requests, and writes what it saw to ``REPORT``
(JSON) before it exits: the worker pids, the node's cgroups and the app's own cgroup
while serving, the replies, and whether its handlers were the same inside and after the
block. Exit 0 when it ran through, 3 when the with-body raised as asked (``raise``), 1
on any other error (its traceback is in the report). The test checks the report, and
from outside what the app leaves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import FrameType
from typing import Any

from broker.client import AsyncClient, Client
from broker.errors import ConfigError
from node.app import Node, NodeStartError
from node.config import load_config
from node.testing import Collector, wait_for

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD)


class BodyFailed(Exception):
    """What the ``raise`` mode's with-body raises."""


def on_signal(signum: int, _frame: FrameType | None) -> None:
    """The app's own handler (never called here: it only has to stay installed)."""
    print(f"app got signal {signum}", file=sys.stderr)


def handlers() -> dict[str, str]:
    """The app's current handlers, by signal name (``repr``, comparable across calls)."""
    return {sig.name: repr(signal.getsignal(sig)) for sig in SIGNALS}


def wakeup_fd() -> int:
    """The current signal wakeup fd (-1: none); leaves it as it was."""
    fd = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(fd)
    return fd


def own_cgroup() -> str:
    return Path("/proc/self/cgroup").read_text()


def node_cgroup_existed(status: dict[str, Any]) -> bool | None:
    """Whether the node's cgroup directory (from its status) exists; None without one.
    (``node.testing.node_cgroup_dirs`` starts from this process's own cgroup,
    which while the node serves is the node's leaf: the test calls it from outside.)"""
    cgroup = status["sandbox"]["cgroup"]
    return None if cgroup is None else Path(cgroup).is_dir()


def serve(node: Node, report: dict[str, Any], rules: bool, kill9: bool) -> None:
    """What the app does while the node serves; fills ``report``."""
    report["handlers_inside"] = handlers()
    report["wakeup_fd_inside"] = wakeup_fd()
    report["cgroup_inside"] = own_cgroup()
    report["pidfile_inside"] = json.loads(node.pidfile.read_text())
    with Client(node.frontend, wait_ms=10_000) as client:
        status = client.status()
        report["sandbox"] = status["sandbox"]
        report["node_cgroup_existed"] = node_cgroup_existed(status)
        report["workers"] = {p["worker_id"]: p["pid"] for p in status["processes"]}
        report["affinity_inside"] = sorted(os.sched_getaffinity(0))
        report["held_inside"] = HELD.cores() if HELD is not None else None
        report["cores"] = status["cores"]
        if rules:
            reply = client.generate("hello there", route="rules")
            report["replies"] = [reply.text, reply.served_by]
        else:
            report["replies"] = [client.generate(f"hello {i}").text for i in range(3)]
        if kill9:
            report["kill9"] = kill9_busy_worker(node, client)
            # Restarted workers are new processes: the test checks these too.
            status = client.status()
            report["workers_after_kill"] = {p["worker_id"]: p["pid"] for p in status["processes"]}
    try:
        Node(load_config(os.environ["EDGENODE_CONFIG"])).start()
        report["second_node"] = "started"
    except ConfigError as exc:
        report["second_node"] = exc.message


def kill9_busy_worker(node: Node, client: Client) -> dict[str, Any]:
    """SIGKILL the worker busy with a slow request: it is made again elsewhere,
    and the killed worker is restarted with its exit seen as SIGKILL."""
    col = Collector(node.frontend)
    try:
        col.send(id="k", op="generate", prompt="!slow 100 a b c d e f g h", max_tokens=9)
        busy = wait_for(lambda: next((w for w in client.status()["workers"] if w["active"]), None))
        os.kill(busy["pid"], signal.SIGKILL)
        col.collect(timeout=10)
        final = col.final("k")

        def restarted() -> dict[str, Any] | None:
            status = client.status()
            (p,) = [p for p in status["processes"] if p["worker_id"] == busy["worker_id"]]
            return p if p["restarts"] == 1 and status["all_ready"] else None

        process = wait_for(restarted, timeout=15)
        return {
            "status": final["status"],
            "text": final.get("text"),
            "victim": busy["worker_id"],
            "served_by": final.get("worker"),
            "last_exit": process["last_exit"],
        }
    finally:
        col.close()


def note_workers(node: Node, report: dict[str, Any]) -> None:
    """The node's worker pids and sandbox, for the test's checks from outside."""
    with Client(node.frontend, wait_ms=10_000) as client:
        status = client.status()
    report["workers"] = {p["worker_id"]: p["pid"] for p in status["processes"]}
    report["sandbox"] = status["sandbox"]


def run_two(config_path: str, report: dict[str, Any]) -> None:
    """A second node in the same process, on a run directory of its own, while the
    first serves: refused (one node per process); the first serves on."""
    with Node(load_config(config_path)) as node:
        note_workers(node, report)
        try:
            Node(load_config(os.environ["EDGENODE_CONFIG2"])).start()
            report["second_node"] = "started"
        except ConfigError as exc:
            report["second_node"] = exc.message
        report["cgroup_inside"] = own_cgroup()
        with Client(node.frontend, wait_ms=10_000) as client:
            report["replies"] = [client.generate("hello").text]


def run_hold(config_path: str, report: dict[str, Any]) -> None:
    """Serve until a line (or EOF) on stdin; "serving" on stdout once ready."""
    with Node(load_config(config_path)) as node:
        note_workers(node, report)
        print("serving", flush=True)
        sys.stdin.readline()


def run_ctrlc(config_path: str, report: dict[str, Any]) -> None:
    """Serve, with a slow request in flight (the stop's drain waits for it), until
    a Ctrl-C; "serving" on stdout once the request runs. More Ctrl-Cs may come
    while the node stops: the stop still finishes."""
    col: Collector | None = None
    try:
        with Node(load_config(config_path)) as node:
            note_workers(node, report)
            col = Collector(node.frontend)
            col.send(id="slow", op="generate", prompt="!slow 200 " + "w " * 20, max_tokens=20)
            with Client(node.frontend, wait_ms=10_000) as client:
                wait_for(lambda: any(w["active"] for w in client.status()["workers"]))
            print("serving", flush=True)
            while True:
                time.sleep(0.05)
    except KeyboardInterrupt:
        report["interrupted"] = True
    finally:
        if col is not None:
            col.close()


def run_sync(config_path: str, report: dict[str, Any], mode: str) -> None:
    config = load_config(config_path)
    if mode == "two":
        run_two(config_path, report)
        return
    if mode == "hold":
        run_hold(config_path, report)
        return
    if mode == "ctrlc":
        run_ctrlc(config_path, report)
        return
    if mode == "forget":
        # Started, never stopped: the main thread ends, the node stops itself.
        node = Node(config).start()
        with Client(node.frontend, wait_ms=10_000) as client:
            report["replies"] = [client.generate("hello").text]
            status = client.status()
        report["workers"] = {p["worker_id"]: p["pid"] for p in status["processes"]}
        report["sandbox"] = status["sandbox"]
        return
    if mode == "timeout":
        # Workers spawn, but 0.3 s is too short for them to register: start
        # stops what it made and says why.
        try:
            with Node(config, start_wait_s=0.3):
                report["body_ran"] = True
        except NodeStartError as exc:
            report["start_error"] = exc.message
        return
    with Node(config) as node:
        report["frontend"] = node.frontend
        serve(node, report, rules=mode == "rules", kill9=mode == "sync")
        if mode == "raise":
            raise BodyFailed("the app's body failed")
        node.stop()  # stop twice (the with's exit is the third)
        node.stop()
        report["running_after_stop"] = node.running


async def run_async(config_path: str, report: dict[str, Any]) -> None:
    """``async with``, and the AsyncClient; a ticker shows the event loop kept
    running while the node started and stopped."""
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    config = load_config(config_path)
    async with Node(config) as node:
        report["ticks_during_start"] = ticks
        report["handlers_inside"] = handlers()
        report["cgroup_inside"] = own_cgroup()

        async with AsyncClient(node.frontend, wait_ms=10_000) as client:
            replies = await asyncio.gather(*(client.generate(f"a{i}") for i in range(3)))
            report["replies"] = [r.text for r in replies]
            status = await client.status()
        report["workers"] = {p["worker_id"]: p["pid"] for p in status["processes"]}
        report["sandbox"] = status["sandbox"]
        report["node_cgroup_existed"] = node_cgroup_existed(status)
        before_stop = ticks
    report["ticks_during_stop"] = ticks - before_stop
    tick_task.cancel()


async def run_async_cancelled(config_path: str, report: dict[str, Any]) -> None:
    """A task cancelled (by ``wait_for``) while its ``async with Node`` starts: the
    start finishes in its thread, then the node is stopped; the body never runs."""
    config = load_config(config_path)

    async def body() -> None:
        async with Node(config):
            report["body_ran"] = True

    try:
        await asyncio.wait_for(body(), timeout=0.3)
    except asyncio.TimeoutError:
        report["cancelled"] = True


class HeldThread:
    """An app thread pinned to its own core (the first allowed) before the node
    starts, as a control-loop thread would be: ``cores()`` reads its affinity."""

    def __init__(self) -> None:
        self.tid = 0
        self.ready, self.done = threading.Event(), threading.Event()
        threading.Thread(target=self._run, daemon=True).start()
        self.ready.wait(5)

    def _run(self) -> None:
        self.tid = threading.get_native_id()
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        self.ready.set()
        self.done.wait()

    def cores(self) -> list[int]:
        return sorted(os.sched_getaffinity(self.tid))


HELD: HeldThread | None = None


def main() -> int:
    config_path, report_path, mode = sys.argv[1:4]
    os.environ["EDGENODE_CONFIG"] = config_path
    logging.basicConfig(level="INFO", format="%(asctime)s %(threadName)s %(name)s %(message)s")
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if mode == "ctrlc":  # Ctrl-C raises KeyboardInterrupt, as in most apps
        signal.signal(signal.SIGINT, signal.default_int_handler)
    report: dict[str, Any] = {
        "pid": os.getpid(),
        "handlers_before": handlers(),
        "wakeup_fd_before": wakeup_fd(),
        "cgroup_before": own_cgroup(),
        "affinity_before": sorted(os.sched_getaffinity(0)),
    }
    global HELD
    HELD = HeldThread()
    report["held_before"] = HELD.cores()
    code = 0
    try:
        if mode == "async":
            asyncio.run(run_async(config_path, report))
        elif mode == "async-cancel":
            asyncio.run(run_async_cancelled(config_path, report))
        else:
            run_sync(config_path, report, mode)
    except BodyFailed as exc:
        report["raised"] = str(exc)
        code = 3
    except BaseException:
        report["error"] = traceback.format_exc()
        code = 1
    report["handlers_after"] = handlers()
    report["wakeup_fd_after"] = wakeup_fd()
    report["cgroup_after"] = own_cgroup()
    report["affinity_after"] = sorted(os.sched_getaffinity(0))
    report["held_after"] = HELD.cores()
    report["ended_at"] = time.time()
    Path(report_path).write_text(json.dumps(report, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
