"""The supervisor rotates a worker's log when it spawns the worker, first start and restarts."""

from __future__ import annotations

import time
from pathlib import Path

from broker.exits import ExitCause
from node.config import from_dict
from node.engine import EngineSpec
from node.pool import WorkerPool
from node.supervisor import Supervisor
from node.worker import WorkerSpec


def test_spawns_rotate_an_oversized_worker_log(tmp_path: Path) -> None:
    spec = WorkerSpec(
        worker_id="llm-0",
        # Nobody listens there: the worker only has to run, not to register.
        backend="tcp://127.0.0.1:1",
        engine=EngineSpec(kind="test", model_path="", n_ctx=512, n_batch=64, threads=1),
    )
    logs = tmp_path / "logs"
    logs.mkdir()
    log = logs / "llm-0.log"
    log.write_bytes(b"previous node run\n" * 20)  # 360 bytes
    sup = Supervisor(
        [spec], logs, ready_timeout_s=60, backoff_s=0, backoff_max_s=0, log_max_bytes=256
    )
    try:
        sup.start()
        assert (logs / "llm-0.log.1").read_bytes() == b"previous node run\n" * 20
        first = sup.handles["llm-0"].pid
        assert first is not None
        with open(log, "ab") as out:  # stands in for a chatty worker
            out.write(b"first process\n" * 20)

        sup.worker_lost("llm-0", first, ExitCause("dead"))
        deadline = time.monotonic() + 10
        while sup.handles["llm-0"].pid in (None, first):
            assert time.monotonic() < deadline, sup.status()
            sup.tick(time.monotonic())
            time.sleep(0.02)

        assert b"first process\n" * 20 in (logs / "llm-0.log.1").read_bytes()
        assert (logs / "llm-0.log.2").read_bytes() == b"previous node run\n" * 20
        assert b"first process" not in log.read_bytes()
        assert not (logs / "llm-0.log.3").exists()
    finally:
        sup.stop(grace_s=5)


def test_the_pool_hands_the_configured_log_size_to_the_supervisor(tmp_path: Path) -> None:
    config = from_dict({"workers": {"engine": "test", "log_max_bytes": 12345}})
    pool = WorkerPool(config, model_path="", rules_path=None, run_dir=tmp_path)
    assert pool.supervisor.log_max_bytes == 12345
