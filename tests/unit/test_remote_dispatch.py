"""Remote host agents' workers in the broker core (fake clock): READY's ``host``,
local-first dispatch, and a lost remote worker's requests."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from broker.errors import ConfigError, ProtocolError
from broker.protocol import WorkerCommand
from broker.records import BrokerSettings
from broker.workers import parse_ready
from brokerkit import FAST, W1, W2, BrokerHarness, bodies, generate

LOCAL = W1
REMOTE = W2


def remote_ready(h: BrokerHarness, now: float, *, slots: int = 1, **fields: Any) -> None:
    """The READY of host agent ``boardb``'s worker ``boardb.llm-0`` (or ``fields``)."""
    body = {"worker_id": "boardb.llm-0", "engine": "llm", "slots": slots, "host": "boardb"}
    h.progress[REMOTE] = 0
    h.worker_send(REMOTE, WorkerCommand.READY, {**body, **fields}, now)


def served_by(h: BrokerHarness) -> dict[int, bytes]:
    """Which worker identity each REQUEST sent so far went to, by broker rid."""
    return {
        m.body["rid"]: m.identity for m in h.drain_workers() if m.command is WorkerCommand.REQUEST
    }


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"host": "boardb", "worker_id": "llm-0"}, "must be 'boardb.<name>'"),
        ({"host": "boardb", "worker_id": "boardc.llm-0"}, "must be 'boardb.<name>'"),
        ({"host": "boardb", "worker_id": "boardb."}, "must be 'boardb.<name>'"),
        ({"host": "a/b", "worker_id": "a/b.llm-0"}, "'host' must match"),
        ({"host": "a.b", "worker_id": "a.b.llm-0"}, "'host' must match"),
        ({"host": "", "worker_id": ".llm-0"}, "'host' must match"),
        ({"host": 7, "worker_id": "7.llm-0"}, "'host' must match"),
        ({"worker_id": "boardb.llm-0"}, "needs the 'host'"),
    ],
)
def test_ready_host_and_worker_id_must_agree(fields: dict[str, Any], words: str) -> None:
    body = {"engine": "llm", "slots": 1, **fields}
    with pytest.raises(ProtocolError, match=words):
        parse_ready(b"x", body, 0.0)


def test_a_remote_ready_is_registered_remote_and_shown_so_in_status() -> None:
    h = BrokerHarness()
    h.ready(LOCAL, 0.0, worker_id="llm-0")
    remote_ready(h, 0.0, slots=2)
    workers = {w["worker_id"]: w for w in h.broker.status(0.0)["workers"]}
    assert (workers["llm-0"]["remote"], workers["llm-0"]["host"]) == (False, None)
    assert (workers["boardb.llm-0"]["remote"], workers["boardb.llm-0"]["host"]) == (True, "boardb")
    assert workers["boardb.llm-0"]["credit"] == 2


def test_a_remote_worker_cannot_take_the_place_of_a_local_one() -> None:
    """A READY replaces the registered worker of the same id: a remote one claiming
    ``llm-0`` would have pushed the node's own worker out."""
    h = BrokerHarness()
    h.ready(LOCAL, 0.0, worker_id="llm-0")
    remote_ready(h, 0.0, worker_id="llm-0")
    refused = bodies(h.drain_workers(), REMOTE, WorkerCommand.DISCONNECT)
    assert refused and "must be 'boardb.<name>'" in refused[0]["reason"]
    assert h.broker.workers.get(LOCAL) is not None
    assert h.broker.workers.get(REMOTE) is None
    assert h.broker.stats.counters["workers_refused"] == 1


def test_local_first_a_free_local_slot_is_used_before_a_remote_one() -> None:
    h = BrokerHarness()
    # The remote one registers first and has more free credit: neither wins over local.
    remote_ready(h, 0.0, slots=4)
    h.ready(LOCAL, 0.0, worker_id="llm-0", slots=1)
    h.drain_workers()
    h.send(generate("a"), 0.1)
    assert list(served_by(h).values()) == [LOCAL]
    # The local slot is taken: the next ones go remote (under load both are used).
    h.send(generate("b"), 0.2)
    h.send(generate("c"), 0.3)
    assert list(served_by(h).values()) == [REMOTE, REMOTE]
    assert h.credit(LOCAL) == 0 and h.credit(REMOTE) == 2


def test_dispatch_credit_spreads_by_free_credit_whatever_the_host() -> None:
    h = BrokerHarness(dataclasses.replace(FAST, dispatch="credit"))
    remote_ready(h, 0.0, slots=4)
    h.ready(LOCAL, 0.0, worker_id="llm-0", slots=1)
    h.drain_workers()
    h.send(generate("a"), 0.1)
    assert list(served_by(h).values()) == [REMOTE]


def test_an_unknown_dispatch_order_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"broker\.dispatch must be one of local_first, credit"):
        BrokerSettings(dispatch="nearest")  # type: ignore[arg-type]


def test_a_silent_remote_worker_is_dead_and_its_request_runs_locally_once() -> None:
    """A lost link is lost workers: missed heartbeats, then the request that
    streamed nothing is re-dispatched on the local worker."""
    h = BrokerHarness()
    h.ready(LOCAL, 0.0, worker_id="llm-0")
    remote_ready(h, 0.0)
    h.drain_workers()
    h.send(generate("busy"), 0.0)
    h.send(generate("remote"), 0.0)
    first = served_by(h)
    assert sorted(first.values()) == sorted([LOCAL, REMOTE])
    (local_rid,) = [rid for rid, ident in first.items() if ident == LOCAL]
    (remote_rid,) = [rid for rid, ident in first.items() if ident == REMOTE]
    h.final(LOCAL, local_rid, 0.05)
    now = 0.0
    while h.broker.workers.get(REMOTE) is not None:  # only the local one beats
        now += 0.05
        h.tick(now, keepalive=(LOCAL,))
        assert now < 2.0
    events = [e for e in h.drain_events() if e.kind == "lost"]
    assert [(e.worker_id, e.cause.verdict if e.cause else None) for e in events] == [
        ("boardb.llm-0", "dead")
    ]
    again = served_by(h)
    assert again == {remote_rid: LOCAL}
    h.final(LOCAL, remote_rid, now)
    replies = {r["id"]: r for r in h.replies()}
    h.assert_each_answered_once()
    assert (replies["remote"]["status"], replies["remote"]["worker"]) == ("ok", "llm-0")
