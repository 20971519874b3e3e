"""A broker alone in its own process, for broker-restart tests:
``python tests/standalone_broker.py FRONTEND BACKEND`` (fast heartbeats)."""

from __future__ import annotations

import signal
import sys

from broker.core import Broker
from broker.loop import BrokerLoop
from broker.records import BrokerSettings


def main() -> None:
    frontend, backend = sys.argv[1], sys.argv[2]
    settings = BrokerSettings(
        heartbeat_interval_ms=100, heartbeat_liveness=3, stall_timeout_ms=2000, cancel_grace_ms=1000
    )
    loop = BrokerLoop(Broker(settings), frontend, backend)
    signal.signal(signal.SIGTERM, lambda *_: loop.stop())
    try:
        loop.run(max_wait_s=0.1)
    finally:
        loop.close()


if __name__ == "__main__":
    main()
