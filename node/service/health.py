"""Whether a node can serve, and its state in one line, from its ``status`` map.

One rule serves ``edgenode status --ready`` (orchestrators' probes) and the
``STATUS=`` line the node sends systemd (``node.service.notify``):

* **stopping**: the node drains (``status.draining``): it admits nothing new.
* **serving**: the engine that answers ``route: "auto"`` requests in the node's
  migration mode (``broker.routing``) has a worker registered with the broker
  (state ``ready`` or ``busy``: it has sent READY and not been lost since):

  - ``shadow`` and ``dual``: the rules answer, so the rule worker;
  - ``full``: the model only, so a model worker, and the circuit breaker not
    ``open`` (an open breaker refuses model work: 503);
  - ``degrade``: a model worker with the breaker not open, or else the rule
    worker (the rules take over when the model cannot serve: the node serves,
    degraded).
* **starting**: not serving, and no worker process has been ready yet (every
  one still in its first ``starting``, none restarted).
* **unavailable**: not serving for any other reason (workers dead, restarting
  or failed; the breaker open in ``full`` mode).

One model worker of several is enough to serve: readiness says whether a
request can be answered now, not whether the node is at full strength (the
line shows ``model 1/2``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from broker.breaker import BreakerState
from broker.kinds import REGISTERED_STATES
from node.pool import RULES_WORKER

#: What ``judge`` concludes; only ``serving`` is ready.
HealthState = Literal["serving", "starting", "stopping", "unavailable"]


@dataclass(frozen=True)
class Health:
    """``state`` (``HealthState``) and the one-line description (``line``)."""

    state: HealthState
    line: str

    @property
    def ready(self) -> bool:
        """Whether the node can serve an ``auto`` request now."""
        return self.state == "serving"


def judge(status: Mapping[str, Any]) -> Health:
    """The node's health from its ``status`` map (module docstring for the rule).

    Reads ``draining``, ``routing.mode``, ``routing.breaker.state``, ``workers``
    (registered: ``kind``, ``state``), ``processes`` (``worker_id``, ``state``,
    ``restarts``), ``pressure`` and ``cpu_pressure``; a missing key counts as
    nothing registered / no process.
    """
    routing = status.get("routing") or {}
    mode = str(routing.get("mode", "degrade"))
    breaker = str((routing.get("breaker") or {}).get("state", BreakerState.CLOSED.value))
    registered = [w for w in status.get("workers") or [] if w.get("state") in REGISTERED_STATES]
    model_up = sum(1 for w in registered if w.get("kind") == "llm")
    rules_up = any(w.get("kind") == "rules" for w in registered)
    processes = list(status.get("processes") or [])
    model_total = sum(1 for p in processes if p.get("worker_id") != RULES_WORKER)
    has_rules = any(p.get("worker_id") == RULES_WORKER for p in processes)
    model_serves = model_up > 0 and breaker != BreakerState.OPEN.value
    if mode in ("shadow", "dual"):
        serves = rules_up
    elif mode == "full":
        serves = model_serves
    else:  # degrade
        serves = model_serves or rules_up
    state: HealthState
    if status.get("draining"):
        state = "stopping"
    elif serves:
        state = "serving"
    elif processes and all(
        p.get("state") == "starting" and not p.get("restarts") for p in processes
    ):
        state = "starting"
    else:
        state = "unavailable"
    rules = ("ready" if rules_up else "down") if has_rules else "off"
    degraded = (
        " (rules only)" if state == "serving" and mode == "degrade" and not model_serves else ""
    )
    line = (
        f"{state}{degraded}: model {model_up}/{model_total} ready, rules {rules}, "
        f"breaker {breaker}, mode {mode}, memory {status.get('pressure', '-')}, "
        f"cpu {status.get('cpu_pressure', '-')}"
    )
    return Health(state, line)
