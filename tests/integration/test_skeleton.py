"""The walking skeleton over real sockets and real worker processes (test engine)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import psutil
import pytest
import zmq

from broker.client import Reply
from broker.errors import ProtocolError
from node.sandbox.niceness import autogroups_enabled, kernel_has_custom_slices, thread_slice_us
from node.sandbox.oom import oom_score_adj
from node.testing import NodeProcess, leftover_processes

NodeFactory = Callable[..., NodeProcess]


def test_generate_chat_and_stream(make_node: NodeFactory) -> None:
    node = make_node()
    with node.client() as c:
        reply = c.generate("turn on the lights", max_tokens=16)
        assert reply.text == "echo: turn on the lights"
        assert reply.usage == {"prompt_tokens": 4, "completion_tokens": 5}
        assert reply.finish_reason == "stop"
        assert reply.served_by == "llm"
        assert reply.total_ms >= reply.queue_ms
        chat = c.chat([{"role": "user", "content": "dock now"}])
        assert chat.text == "echo: dock now"
        stream = c.stream_generate("a b c d", max_tokens=3)
        pieces = list(stream)
        assert pieces == ["echo:", " a", " b"]
        assert stream.result is not None and stream.result.text == "echo: a b"
        assert stream.result.finish_reason == "length"


def test_two_workers_run_in_parallel_and_third_waits_for_credit(make_node: NodeFactory) -> None:
    node = make_node()
    replies: dict[int, Reply] = {}
    statuses: list[dict[str, Any]] = []

    def ask(i: int) -> None:
        with node.client() as c:
            replies[i] = c.generate(f"!slow 150 request {i} x y", max_tokens=6)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    # Sample while all three are in: two running (no credit left), one queued.
    for _ in range(40):
        s = node.status()
        statuses.append(s)
        if s["in_flight"] == 2 and s["queue_depth"] == 1:
            break
        threading.Event().wait(0.02)
    for t in threads:
        t.join(10)
    assert any(
        s["in_flight"] == 2 and s["queue_depth"] == 1 and s["credit"] == 0 for s in statuses
    ), statuses
    ordered = sorted(replies.values(), key=lambda r: r.queue_ms)
    first, second, third = ordered
    assert {first.raw["worker"], second.raw["worker"]} == {"llm-0", "llm-1"}
    # The third request waited for a FINAL to return credit (~6 tokens x 150 ms).
    assert third.queue_ms >= 500 > second.queue_ms
    assert node.status()["credit"] == 2


@pytest.fixture(scope="module")
def one_worker(make_module_node: NodeFactory) -> NodeProcess:
    """One node with one worker for the tests that only send it requests."""
    return make_module_node(workers={"count": 1})


def _raw_dealer(endpoint: str) -> zmq.Socket[bytes]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 3000)
    sock.connect(endpoint)
    return sock


def _reply(sock: zmq.Socket[bytes]) -> dict[str, Any]:
    frames = sock.recv_multipart()
    assert frames[:2] == [b"", b"EDGE/C1"]
    body: dict[str, Any] = msgpack.unpackb(frames[2])
    return body


@pytest.mark.parametrize(
    ("frames", "code", "needle"),
    [
        ([b"", b"EDGE/C1", b"\xc1not msgpack"], 400, "msgpack"),
        ([b"", b"EDGE/C1"], 400, "frames"),
        ([b"", b"EDGE/C1", msgpack.packb({"id": 1}), b"extra"], 400, "frames"),
        ([b"", b"EDGE/C9", msgpack.packb({"id": 1, "op": "ping"})], 400, "EDGE/C1"),
        ([b"", b"EDGE/C1", msgpack.packb([1, 2])], 400, "map"),
        ([b"", b"EDGE/C1", msgpack.packb({"id": 1, "op": "dance"})], 400, "'op'"),
        ([b"", b"EDGE/C1", msgpack.packb({"id": 1, "op": "generate"})], 400, "'prompt'"),
        (
            [b"", b"EDGE/C1", msgpack.packb({"id": 1, "op": "generate", "prompt": 5})],
            400,
            "'prompt'",
        ),
        (
            [
                b"",
                b"EDGE/C1",
                msgpack.packb({"id": 1, "op": "generate", "prompt": "x", "max_tokens": "ten"}),
            ],
            400,
            "'max_tokens'",
        ),
        ([b"", b"EDGE/C1", msgpack.packb({"op": "ping"})], 400, "'id'"),
        (
            [b"", b"EDGE/C1", msgpack.packb({"id": 1, "op": "generate", "prompt": "x" * 300_000})],
            413,
            "limit",
        ),
    ],
)
def test_malformed_messages_get_typed_errors_and_the_broker_stays_up(
    one_worker: NodeProcess, frames: list[bytes], code: int, needle: str
) -> None:
    node = one_worker
    sock = _raw_dealer(node.frontend)
    try:
        sock.send_multipart(frames)
        reply = _reply(sock)
        assert reply["status"] == "error"
        assert reply["code"] == code
        assert needle in reply["message"]
        # Exactly one reply for the bad message; the next valid request succeeds.
        sock.send_multipart(
            [
                b"",
                b"EDGE/C1",
                msgpack.packb({"id": "ok-1", "op": "generate", "prompt": "still here"}),
            ]
        )
        good = _reply(sock)
        assert (good["id"], good["status"], good["text"]) == ("ok-1", "ok", "echo: still here")
    finally:
        sock.close(0)


def test_client_raises_typed_error(one_worker: NodeProcess) -> None:
    with one_worker.client() as c, pytest.raises(ProtocolError, match="temperature"):
        c.generate("x", temperature=99)


def test_cli_background_start_status_ask_stop(make_node: NodeFactory) -> None:
    node = make_node(start=False)
    started = node.cli("start", "--wait-s", "60")
    assert started.returncode == 0, started.stderr + started.stdout
    status = node.cli("status")
    assert status.returncode == 0, status.stderr
    assert status.stdout.count(" ready ") == 2, status.stdout
    pids = node.worker_pids()
    assert len(pids) == 2
    answer = node.cli("ask", "robot move forward", "--raw")
    assert answer.returncode == 0, answer.stderr
    assert "echo: robot move forward" in answer.stdout
    assert "completion tokens" in answer.stderr
    # A refusal names its machine reason, the one apps branch on.
    refused = node.cli("ask", "too long", "--raw", "--max-tokens", "4096")
    assert refused.returncode == 1
    assert "413 TOO_LARGE [too_large]: prompt " in refused.stderr, refused.stderr
    # --json prints the error reply too (it printed nothing on stdout).
    as_json = node.cli("--json", "ask", "too long", "--raw", "--max-tokens", "4096")
    assert as_json.returncode == 1
    body = json.loads(as_json.stdout)
    assert (body["status"], body["code"], body["reason"]) == ("error", 413, "too_large"), body
    assert body["message"].startswith("prompt "), body
    stopped = node.cli("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert leftover_processes(node.run_dir) == []
    assert node.cli("status").returncode == 3


def test_start_refuses_a_plan_that_cannot_fit(make_node: NodeFactory) -> None:
    node = make_node(
        start=False,
        workers={"count": 40},
        capacity={"memory_budget": "2G", "reserve": "512M", "runtime_overhead": "88M"},
    )
    result = node.cli("start", "--wait-s", "30")
    assert result.returncode == 1
    assert "40 worker(s) do not fit" in result.stderr and "workers.count" in result.stderr
    assert leftover_processes(node.run_dir) == []
    assert not (node.run_dir / "edgenode.pid").exists()


@pytest.mark.parametrize("cpus", ["auto", [1]], ids=["default-auto", "listed"])
def test_reserved_cores_keep_the_whole_node_off_the_hosts_cores(
    make_node: NodeFactory, cpus: str | list[int]
) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if not {0, 1} <= set(allowed):
        pytest.skip(f"needs cores 0 and 1; this process may use {allowed}")
    # "auto" (the default; the suite's nodes share every core unless told) keeps the
    # first allowed core for the host: here every core but core 0.
    reserved = allowed[1:] if cpus == "auto" else [1]
    node = make_node(workers={"cpus": cpus}, fallback={"rules": "default"})
    status = node.status()
    by_id = {p["worker_id"]: p for p in status["processes"]}
    assert status["cores"] == {
        "setting": cpus,
        "reserved": True,
        "workers": reserved,
        "host": [c for c in allowed if c not in reserved],
        "node": reserved,
    }
    # The broker and the rules follow the reservation (node.cpus = []), ahead
    # of the workers by nice level: core 0 is the host's alone.
    assert psutil.Process(status["pid"]).cpu_affinity() == reserved
    # Every thread, including those a library started at import (numpy's OpenBLAS pool).
    for thread in psutil.Process(status["pid"]).threads():
        assert os.sched_getaffinity(thread.id) == set(reserved), thread
    assert psutil.Process(by_id["rules-0"]["pid"]).cpu_affinity() == reserved
    assert by_id["rules-0"]["nice"] == 0
    for wid in ("llm-0", "llm-1"):
        assert psutil.Process(by_id[wid]["pid"]).cpu_affinity() == reserved
        assert psutil.Process(by_id[wid]["pid"]).nice() == 10
        # ... and so is its session's autogroup, else nice 10 ranks it only
        # within its own session (node/sandbox/niceness.py).
        assert by_id[wid]["nice"] == 10
        assert by_id[wid]["autogroup_nice"] == (10 if autogroups_enabled() else None)
        # The shortest scheduler slice, on every thread (llama.cpp's too): a host thread
        # that wakes on a worker's core waits ~0.1 ms, not a tick (niceness.set_slice).
        want = 100 if kernel_has_custom_slices() else thread_slice_us(os.getpid())
        assert by_id[wid]["slice_us"] == want
        threads = psutil.Process(by_id[wid]["pid"]).threads()
        assert {thread_slice_us(t.id) for t in threads} == {want}
    # Ahead of the model: the kernel's default slice, as this test's own.
    assert by_id["rules-0"]["slice_us"] == thread_slice_us(os.getpid())
    # The OOM killer's first pick: the model workers, not the broker nor the rules
    # (they keep what they inherited: this test's own value).
    own = oom_score_adj(os.getpid())
    assert [by_id[wid]["oom_score_adj"] for wid in ("llm-0", "llm-1")] == [500, 500]
    assert by_id["rules-0"]["oom_score_adj"] == own == oom_score_adj(status["pid"])
    with node.client() as client:
        assert client.generate("go", max_tokens=2).served_by == "llm"


def test_node_cpus_put_the_broker_and_rules_on_the_given_cores(make_node: NodeFactory) -> None:
    node = make_node(node={"cpus": [0]}, workers={"cpus": [1]}, fallback={"rules": "default"})
    status = node.status()
    by_id = {p["worker_id"]: p for p in status["processes"]}
    assert psutil.Process(status["pid"]).cpu_affinity() == [0]
    assert psutil.Process(by_id["rules-0"]["pid"]).cpu_affinity() == [0]
    assert psutil.Process(by_id["llm-0"]["pid"]).cpu_affinity() == [1]


def test_a_pinned_broker_does_not_confine_unreserved_workers(make_node: NodeFactory) -> None:
    """``node.cpus = [0]`` with ``workers.cpus = []``: the workers may use every core,
    as planned; they used to inherit the broker's pinning (two threads on core 0,
    the host's) while status said "all"."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip(f"needs two cores; this process may use {allowed}")
    node = make_node(node={"cpus": [allowed[0]]}, workers={"count": 1, "cpus": []})
    status = node.status()
    (llm,) = [p for p in status["processes"] if p["worker_id"] == "llm-0"]
    assert psutil.Process(status["pid"]).cpu_affinity() == [allowed[0]]
    assert psutil.Process(llm["pid"]).cpu_affinity() == allowed
    assert llm["cpus"] == allowed  # status says where it runs
