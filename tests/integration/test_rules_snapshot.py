"""The node serves the rules it validated at start (issue 11, break-it finding
rules_edit_while_running.sh), with a real node and real worker processes.

Before the fix, the rule worker read the configured rules file itself at every spawn. A
file broken on disk while the node ran took the rule engine down for good once the rule
worker was lost: the restarted ``rules-0`` exited 66 ("model failed to load"), was never
retried, and ``route: rules`` requests waited until their deadline. A valid edit was
silently picked up by such a restart, so the node ran rules ``start`` never checked.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.engine import EngineSpec
from node.model import RULES_SNAPSHOT
from node.supervisor import Supervisor
from node.testing import NodeProcess, ask_rules, wait_for
from node.worker import WorkerSpec

NodeFactory = Callable[..., NodeProcess]

RULES = """\
[[rule]]
name = "greeting"
any = ["hello"]
text = "hi"
confidence = 1
"""
#: A valid edit: the same trigger answered by a rule of another name.
EDITED = RULES.replace('"greeting"', '"edited_greeting"').replace('"hi"', '"edited"')
BROKEN = "garbage [[[\n"


def rule_worker(node: NodeProcess) -> dict[str, Any] | None:
    """``rules-0``'s process entry once it is registered and ready, else None."""
    status = node.status()
    registered = [w for w in status["workers"] if w["kind"] == "rules"]
    (process,) = [p for p in status["processes"] if p["worker_id"] == "rules-0"]
    if registered and registered[0]["state"] == "ready" and process["state"] == "ready":
        return dict(process)
    return None


def restarted_rule_worker(node: NodeProcess, old_pid: int) -> dict[str, Any]:
    """Wait for a new ``rules-0`` process, registered and ready (fails after 30 s with the
    worker's status, e.g. "failed ... exit 66")."""

    def check() -> dict[str, Any] | None:
        process = rule_worker(node)
        # A live new pid: a snapshot between the reap and the respawn shows pid None.
        fresh = process is not None and process["pid"] not in (None, old_pid)
        return process if fresh else None

    try:
        found: dict[str, Any] = wait_for(check, timeout=30)
    except AssertionError as exc:  # wait_for says "condition not met"
        (process,) = [p for p in node.status()["processes"] if p["worker_id"] == "rules-0"]
        raise AssertionError(f"the rule worker did not come back: {process}") from exc
    return found


#: Each rules request's budget: the restarted rule worker must answer within it.
BUDGET_MS = 10_000


def kill_rule_worker(node: NodeProcess) -> int:
    process = wait_for(lambda: rule_worker(node), timeout=30)
    os.kill(process["pid"], signal.SIGKILL)
    return int(process["pid"])


def test_a_rules_file_broken_while_running_does_not_reach_the_restarted_rule_worker(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    node = make_node(workers={"count": 1}, fallback={"rules": str(rules)})
    assert (node.run_dir / RULES_SNAPSHOT).read_text() == RULES
    assert ask_rules(node, "before", "hello there", BUDGET_MS)["rule"] == "greeting"

    rules.write_text(BROKEN)  # edited on disk while the node runs
    old = kill_rule_worker(node)  # lost, as a crash, a hang or a stall would lose it

    restarted = restarted_rule_worker(node, old)
    assert restarted["restarts"] == 1, (old, restarted, node.status()["processes"])
    # The broken file has no rule at all: this answer comes from the rules start checked.
    reply = ask_rules(node, "after", "hello there", BUDGET_MS)
    assert reply["status"] == "ok", reply
    assert (reply["served_by"], reply["rule"], reply["text"]) == ("rules", "greeting", "hi")


def test_a_valid_edit_takes_effect_at_the_next_start_only(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    rules = tmp_path / "rules.toml"
    rules.write_text(RULES)
    node = make_node(workers={"count": 1}, fallback={"rules": str(rules)})

    rules.write_text(EDITED)
    restarted_rule_worker(node, kill_rule_worker(node))
    assert (
        ask_rules(node, "restart", "hello there", BUDGET_MS)["rule"] == "greeting"
    )  # not checked yet

    assert node.stop() == 0
    assert not (node.run_dir / RULES_SNAPSHOT).exists()  # a stop removes what start made
    node.start()
    assert (node.run_dir / RULES_SNAPSHOT).read_text() == EDITED
    assert ask_rules(node, "next-start", "hello there", BUDGET_MS)["rule"] == "edited_greeting"


def test_a_rule_worker_that_cannot_load_its_rules_says_so(tmp_path: Path) -> None:
    """Exit 66 of the rule worker names the rules and their first error, not a model."""
    bad = tmp_path / "rules.toml"
    bad.write_text(BROKEN)
    spec = WorkerSpec(
        worker_id="rules-0",
        backend="tcp://127.0.0.1:1",  # never reached: the load fails first
        engine=EngineSpec(kind="rules", model_path=str(bad), n_ctx=0, n_batch=0, threads=1),
    )
    sup = Supervisor([spec], tmp_path / "logs", ready_timeout_s=60, backoff_s=0, backoff_max_s=0)
    try:
        sup.start()
        handle = sup.handles["rules-0"]

        def failed() -> bool:
            sup.tick(time.monotonic())
            return handle.state == "failed"

        wait_for(failed, timeout=30)
        assert handle.last_exit.startswith(f"exit 66: rules failed to load: {bad}: not valid TOML")
        assert "\n" not in handle.last_exit
        assert "model" not in handle.last_exit
    finally:
        sup.stop(grace_s=5)
