"""Faults with real processes: every accepted request gets exactly one final reply,
credit balances afterwards, and the broker keeps serving.

Nodes here run the test engine with 100 ms heartbeats x 3 (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from broker.client import Client
from broker.errors import EdgeNodeError
from node.engine import EngineSpec
from node.model import resolve_model
from node.testing import REPO, Collector, NodeProcess, wait_for
from node.worker import WorkerSpec

NodeFactory = Callable[..., NodeProcess]


def busy_worker(node: NodeProcess) -> dict[str, Any]:
    """Wait until a worker is busy and return its status entry."""
    return wait_for(lambda: next((w for w in node.status()["workers"] if w["active"]), None))


def healthy_again(node: NodeProcess, count: int) -> dict[str, Any]:
    """Wait until ``count`` workers are registered and idle with full credit."""

    def check() -> dict[str, Any] | None:
        s = node.status()
        ok = len(s["workers"]) == count and s["credit"] == count and s["all_ready"]
        return s if ok and s["in_flight"] == 0 and s["queue_depth"] == 0 else None

    return wait_for(check, timeout=15)


def restarts(status: dict[str, Any]) -> dict[str, tuple[int, str]]:
    return {p["worker_id"]: (p["restarts"], p["last_exit"]) for p in status["processes"]}


def test_kill9_busy_worker_request_is_redispatched(make_node: NodeFactory) -> None:
    node = make_node()
    col = Collector(node.frontend)
    try:
        col.send(id="a", op="generate", prompt="!slow 100 a b c d e f g h", max_tokens=9)
        victim = busy_worker(node)
        os.kill(victim["pid"], signal.SIGKILL)
        col.collect(timeout=10)
        col.assert_exactly_one_final_each()
        reply = col.final("a")
        assert reply["status"] == "ok", reply
        assert reply["text"] == "echo: !slow 100 a b c d e f"  # made again, whole
        assert reply["worker"] != victim["worker_id"]
        status = healthy_again(node, 2)
        assert restarts(status)[victim["worker_id"]] == (1, "killed by SIGKILL")
    finally:
        col.close()


def test_kill9_of_a_streaming_worker_gives_503_with_partial_text(make_node: NodeFactory) -> None:
    node = make_node()
    col = Collector(node.frontend)
    try:
        col.send(
            id="s", op="generate", prompt="!slow 100 a b c d e f g h", max_tokens=9, stream=True
        )
        wait_for(lambda: len(col.replies.get("s", [])) >= 2 or col.collect(False, 0.05, 0))
        victim = busy_worker(node)
        os.kill(victim["pid"], signal.SIGKILL)
        col.collect(timeout=10)
        col.assert_exactly_one_final_each()
        final = col.final("s")
        assert (final["status"], final["code"], final["reason"]) == ("error", 503, "worker_lost")
        streamed = "".join(r["text"] for r in col.replies["s"] if r["status"] == "partial")
        assert final["text"] == streamed and streamed.startswith("echo:")
        healthy_again(node, 2)
    finally:
        col.close()


def test_sigstop_busy_worker_is_declared_dead_and_sigcont_adds_no_reply(
    make_node: NodeFactory,
) -> None:
    node = make_node()
    col = Collector(node.frontend)
    try:
        col.send(id="a", op="generate", prompt="!slow 100 a b c d e f g h", max_tokens=9)
        victim = busy_worker(node)
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped_at = time.monotonic()
        wait_for(
            lambda: all(w["pid"] != victim["pid"] for w in node.status()["workers"]), every=0.01
        )
        detected_in = time.monotonic() - stopped_at
        with contextlib.suppress(ProcessLookupError):  # already killed and reaped
            os.kill(victim["pid"], signal.SIGCONT)
        col.collect(timeout=10, linger=1.0)
        col.assert_exactly_one_final_each()
        assert col.final("a")["status"] == "ok"
        # liveness x interval + one interval = 400 ms; the slack covers status polling.
        assert detected_in < 0.4 + 0.5, detected_in
        status = healthy_again(node, 2)
        assert "dead" in restarts(status)[victim["worker_id"]][1]
    finally:
        col.close()


def test_worker_that_ignores_cancel_is_treated_as_hung(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1})
    col = Collector(node.frontend)
    try:
        col.send(id="h", op="generate", prompt="!hang", timeout_ms=300)
        col.collect(timeout=5)
        final = col.final("h")
        assert (final["status"], final["code"]) == ("error", 504)
        status = healthy_again(node, 1)
        assert restarts(status)["llm-0"] == (
            1,
            "hung: no ack to CANCEL within the grace (killed by SIGKILL)",
        )
        with node.client() as c:
            assert c.generate("after restart").text == "echo: after restart"
    finally:
        col.close()


def test_stalled_workers_are_restarted_and_the_request_gets_503(make_node: NodeFactory) -> None:
    node = make_node()
    col = Collector(node.frontend)
    try:
        # Both workers hang in turn: one re-dispatch, then a typed 503.
        col.send(id="h", op="generate", prompt="!hang", timeout_ms=20_000)
        col.collect(timeout=15)
        final = col.final("h")
        assert (final["code"], final["reason"]) == (503, "worker_lost")
        assert "stalled" in final["message"]
        status = healthy_again(node, 2)
        assert all(r == 1 for r, _ in restarts(status).values())
    finally:
        col.close()


def test_cancel_queued_and_running_requests(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1})
    col = Collector(node.frontend)
    try:
        col.send(id="run", op="generate", prompt="!slow 200 a b c d e f", stream=True)
        col.send(id="queued", op="generate", prompt="never runs")
        wait_for(lambda: node.status()["queue_depth"] == 1)
        col.send(id="c1", op="cancel", target="queued")
        col.send(id="c2", op="cancel", target="run")
        col.send(id="c3", op="cancel", target="no-such-id")
        col.collect(timeout=5)
        col.assert_exactly_one_final_each()
        assert (col.final("queued")["code"], col.final("run")["code"]) == (499, 499)
        assert col.final("c1") == {"id": "c1", "status": "ok", "cancelled": "queued"}
        assert col.final("c2")["status"] == "ok"
        assert col.final("c3")["code"] == 404
        status = healthy_again(node, 1)  # the worker acked: its credit is back
        assert restarts(status)["llm-0"][0] == 0
        assert status["counters"].get("ok", 0) == 0  # neither ran to completion
    finally:
        col.close()


def test_deadline_shorter_than_one_token(make_node: NodeFactory) -> None:
    node = make_node(workers={"count": 1})
    col = Collector(node.frontend)
    try:
        col.send(id="d", op="generate", prompt="!slow 500 x y", timeout_ms=50)
        col.collect(timeout=5)
        final = col.final("d")
        assert (final["code"], final.get("text", "")) == (504, "")
        healthy_again(node, 1)
        with node.client() as c:
            assert c.generate("next").text == "echo: next"
    finally:
        col.close()


# --------------------------------------------------------------------------- broker restart


def _spawn_worker(worker_id: str, backend: str, log: Path) -> subprocess.Popen[bytes]:
    spec = WorkerSpec(
        worker_id=worker_id,
        backend=backend,
        engine=EngineSpec(
            kind="test", model_path="", n_ctx=512, n_batch=64, threads=1, test_token_ms=10
        ),
        heartbeat_interval_ms=100,
        heartbeat_liveness=3,
    )
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "node.worker",
                "--spec",
                spec.to_json(),
                "--keep-without-parent",
            ],
            stdout=out,
            stderr=out,
            cwd=REPO,
        )


def test_broker_restart_workers_reregister(tmp_path: Path) -> None:
    run = tmp_path
    frontend, backend = f"ipc://{run}/f.sock", f"ipc://{run}/w/b.sock"
    script = str(REPO / "tests" / "standalone_broker.py")

    def start_broker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, script, frontend, backend],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    broker = start_broker()
    workers = [_spawn_worker(f"llm-{i}", backend, tmp_path / f"w{i}.log") for i in range(2)]
    try:
        with Client(frontend, wait_ms=5000) as c:
            wait_for(lambda: len(c.status()["workers"]) == 2)
            pids_before = sorted(w["pid"] for w in c.status()["workers"])
            assert c.generate("before").text == "echo: before"
        broker.kill()
        broker.wait()
        broker = start_broker()
        with Client(frontend, wait_ms=5000) as c:
            status = wait_for(lambda: (s := c.status()) and len(s["workers"]) == 2 and s)
            # The same processes registered again (fresh identities, same pids).
            assert sorted(w["pid"] for w in status["workers"]) == pids_before
            assert c.generate("after").text == "echo: after"
        assert all(w.poll() is None for w in workers)
    finally:
        for proc in [broker, *workers]:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- no false deaths


def test_a_paused_node_kills_none_of_its_workers(make_node: NodeFactory) -> None:
    # SIGSTOP of the node (broker) for 15 heartbeat livenesses, past the workers'
    # link timeout (10 livenesses: node.worker.LINK_TIMEOUT_LIVENESSES): the workers
    # give up on it and re-register; the broker, resumed, must not blame them for
    # its pause: each old incarnation is replaced, none is killed.
    node = make_node()
    assert node.proc is not None
    before = healthy_again(node, 2)
    os.kill(node.proc.pid, signal.SIGSTOP)
    time.sleep(4.5)
    os.kill(node.proc.pid, signal.SIGCONT)
    time.sleep(1.0)  # time for a wrongful verdict, its kill and the reaping
    after = healthy_again(node, 2)
    assert restarts(after) == restarts(before)
    assert after["counters"].get("workers_lost", 0) == 2, after["counters"]  # both replaced
    assert {p["pid"] for p in after["processes"]} == {p["pid"] for p in before["processes"]}
    assert after["routing"]["breaker"]["state"] == "closed"
    with Client(node.frontend, wait_ms=5000) as c:
        assert c.generate("after the pause").text == "echo: after the pause"


def test_streams_in_flight_survive_a_pause_of_the_node(make_node: NodeFactory) -> None:
    # Busy workers used to give up on the silent broker, cancel their requests and
    # re-register: both streams ended 503 worker_lost after the pause.
    node = make_node()
    assert node.proc is not None
    col = Collector(node.frontend)
    try:
        words = " ".join(f"w{i}" for i in range(20))
        for rid in ("s1", "s2"):
            col.send(id=rid, op="generate", prompt=f"!slow 100 {words}", max_tokens=30, stream=True)
        wait_for(lambda: sum(bool(w["active"]) for w in node.status()["workers"]) == 2)
        os.kill(node.proc.pid, signal.SIGSTOP)
        time.sleep(1.0)  # > 3 x 100 ms: both workers hear nothing from the broker
        os.kill(node.proc.pid, signal.SIGCONT)
        col.collect(timeout=15)
        col.assert_exactly_one_final_each()
        for rid in ("s1", "s2"):
            final = col.final(rid)
            assert final["status"] == "ok", final
            assert final["text"] == "echo: !slow 100 " + words
    finally:
        col.close()
    assert all(r == (0, "") for r in restarts(node.status()).values())


def test_requests_that_end_during_a_pause_of_the_node_run_once(make_node: NodeFactory) -> None:
    # A user's report: a worker whose request ended while the node was stopped
    # re-registered once idle (the broker silent past 3 x 100 ms) under a fresh
    # identity. The resumed broker read that READY before the old identity's FINAL,
    # took the request for lost and ran it again: the model did the work twice.
    node = make_node(workers={"count": 2, "slots": 2})
    assert node.proc is not None
    col = Collector(node.frontend)
    words = " ".join(f"w{i}" for i in range(8))
    prompt = f"!slow 60 {words}"  # 9 tokens x 60 ms: each ends ~0.5 s into the pause
    try:
        for i in range(4):
            col.send(id=f"r{i}", op="generate", prompt=prompt, max_tokens=200, timeout_ms=12000)
        wait_for(lambda: sum(w["active"] for w in node.status()["workers"]) == 4)
        os.kill(node.proc.pid, signal.SIGSTOP)
        # Idle and unheard-from for ~1 s (> 3 x 100 ms), yet well inside the
        # link timeout (10 x 3 x 100 ms) after which a worker gives a silent broker up.
        time.sleep(1.5)
        os.kill(node.proc.pid, signal.SIGCONT)
        col.collect(timeout=15)
        col.assert_exactly_one_final_each()
        for i in range(4):
            final = col.final(f"r{i}")
            assert final["status"] == "ok", final
            assert final["text"] == "echo: " + prompt
    finally:
        col.close()
    time.sleep(0.3)  # a few heartbeats: their `started` counts are up to date
    status = node.status()
    # Each request taken into a slot exactly once, by the workers registered now.
    assert sum(w["started"] for w in status["workers"]) == 4, status["workers"]
    assert status["counters"].get("workers_lost", 0) == 0, status["counters"]
    assert all(r == (0, "") for r in restarts(status).values())


#: The heartbeat of the no-false-death test: its first version's ratios (load 4 x, generation
#: 30 x, stall timeout 15 x the interval) at 500 ms (the default) instead of 1000 ms, so the
#: run lasts 17 s, not 34 s, and still spans 30 heartbeats; its liveness window (1.5 s) is
#: 5 x that of every other test here (FAST_BROKER's 300 ms): a loaded machine is no threat.
BEAT_MS = 500


def test_no_false_death_on_a_30_heartbeat_generation_and_slow_load(
    make_node: NodeFactory,
) -> None:
    # A model load longer than the liveness window (4 beats > 3) and a generation spanning
    # 30 beats, twice the stall timeout: neither is a dead or stalled worker.
    node = make_node(
        workers={"count": 1, "test_load_ms": 4 * BEAT_MS},
        broker={
            "heartbeat_interval_ms": BEAT_MS,
            "heartbeat_liveness": 3,
            "stall_timeout_ms": 15 * BEAT_MS,
        },
    )
    words = " ".join(f"w{i}" for i in range(27))  # 30 tokens with "echo: !slow BEAT_MS"
    with node.client() as c:
        reply = c.generate(f"!slow {BEAT_MS} {words}", max_tokens=30, timeout_ms=60_000)
    assert reply.text.endswith(" w26") and reply.total_ms >= 30 * BEAT_MS
    status = node.status()
    assert restarts(status)["llm-0"] == (0, "")
    assert status["counters"].get("workers_lost", 0) == 0


def test_deterministic_start_failure_is_not_restarted(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    bad = tmp_path / "truncated.gguf"
    # The real model's header and metadata (so the capacity check passes) without
    # most of its tensor data: llama.cpp refuses to load it, every time.
    with open(resolve_model("default"), "rb") as src:
        bad.write_bytes(src.read(8_000_000))
    node = make_node(start=False, model={"path": str(bad)}, workers={"engine": "llama"})
    result = node.cli("start", "--wait-s", "60")
    # A background start says why, and stops the node it launched.
    assert result.returncode == 1
    assert "model failed to load" in result.stderr, result.stderr
    assert node.cli("status").returncode != 0
    # A node left running (foreground) keeps its failed workers failed, not respawned.
    node.start(timeout=60, ready=False)
    try:
        # Every worker fails on its own clock; then a second more is long enough
        # for several backoff restarts, were there any.
        wait_for(lambda: all(p["state"] == "failed" for p in node.status()["processes"]), 30)
        time.sleep(1.0)
        status = node.status()
        assert {p["state"] for p in status["processes"]} == {"failed"}
        assert all(p["restarts"] == 0 for p in status["processes"])
        with pytest.raises(EdgeNodeError), node.client() as c:
            c.generate("x", timeout_ms=200)
    finally:
        assert node.cli("stop").returncode == 0
    assert json.dumps(status)  # the status map stays JSON-able for `status --json`
