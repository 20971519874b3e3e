"""``BrokerLoop.flush``: the node hears of a batch of effects before its frames go out,
and the frames go out even when the node's handler fails (a real loop, real sockets)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from broker.core import Broker
from broker.delivery import Outgoing
from broker.loop import BrokerLoop
from broker.outbox import Effects
from broker.protocol import WorkerCommand
from broker.records import BrokerSettings

CLIENT = b"client-a"
WORKER = b"worker-1"


@pytest.fixture
def run_dir() -> Iterator[Path]:
    run = Path(tempfile.mkdtemp(prefix="en-"))
    yield run
    shutil.rmtree(run, ignore_errors=True)


def loop_logging(run: Path, log: list[str], fail: bool = False) -> BrokerLoop:
    """A loop whose ``on_effects`` and sends append to ``log`` in the order they happen."""

    def on_effects(effects: Effects) -> None:
        log.append(f"effects:{len(effects.clients)}+{len(effects.workers)}")
        if fail:
            raise RuntimeError("the node's handler failed")

    loop = BrokerLoop(
        Broker(BrokerSettings()), f"ipc://{run}/f.sock", f"ipc://{run}/b.sock", on_effects
    )

    def send_client(out: Outgoing) -> None:
        log.append(f"client:{out.body['id']}")

    def send(sock: object, frames: list[bytes]) -> None:
        log.append(f"worker:{frames[0].decode()}")

    loop._send_client = send_client  # type: ignore[method-assign]
    loop._send = send  # type: ignore[method-assign]
    return loop


def queue_final_and_cancel(loop: BrokerLoop) -> None:
    loop.broker.outbox.client(CLIENT, {"id": "r1", "status": "ok"})
    loop.broker.outbox.worker(WORKER, WorkerCommand.CANCEL, {"rid": 1})


def test_the_node_hears_of_a_final_before_the_client_can(run_dir: Path) -> None:
    # A client that scraped /metrics as soon as its FINAL arrived found its request
    # not yet counted (CI, tests/system/test_metrics_model.py): the loop sent the
    # FINAL first and handed the observation to the node after.
    log: list[str] = []
    loop = loop_logging(run_dir, log)
    try:
        queue_final_and_cancel(loop)
        loop.flush()
    finally:
        loop.close()
    assert log == ["effects:1+1", "worker:worker-1", "client:r1"]


def test_a_failing_handler_loses_no_frame(run_dir: Path) -> None:
    log: list[str] = []
    loop = loop_logging(run_dir, log, fail=True)
    try:
        queue_final_and_cancel(loop)
        with pytest.raises(RuntimeError, match="handler failed"):
            loop.flush()
        assert not loop.broker.outbox  # taken once, not queued again
    finally:
        loop.close()
    assert log == ["effects:1+1", "worker:worker-1", "client:r1"]
