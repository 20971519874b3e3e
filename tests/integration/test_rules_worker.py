"""Rules cannot hurt the rule worker (issue 11), with a real node: test-engine model workers
and the real rule worker ``rules-0``, 100 ms heartbeats x 3 and a 2 s stall timeout
(tests/conftest.py).

Before RE2, a rules file with a catastrophic regex such as ``(a+)+$`` passed ``rules check``;
one short prompt then held the rule worker's GIL in Python's backtracking ``re`` (no more
heartbeats: "dead"), and the broker re-dispatched the request to the restarted rule worker,
which died the same way.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest

from fallback.engine import HANG_ON_ENV, MAX_MATCH_CHARS
from node.testing import NodeProcess, ask_rules, leftover_processes, wait_for

NodeFactory = Callable[..., NodeProcess]

#: A catastrophic-looking pattern RE2 accepts (it has no backtracking), then a plain rule.
REDOS_RULES = """\
[[rule]]
name = "redos"
regex = '''(a+)+$'''
text = "ends in a"
confidence = 1

[[rule]]
name = "greeting"
any = ["hello"]
text = "hi"
confidence = 1
"""
#: Exponential for a backtracking engine: every split of the a's is tried before "!" fails.
SHORT_ADVERSARIAL = "a" * 40 + "!"


def rules_file(tmp_path: Path, text: str = REDOS_RULES) -> str:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    return str(path)


def rule_worker(status: dict[str, Any]) -> dict[str, Any]:
    (process,) = [p for p in status["processes"] if p["worker_id"] == "rules-0"]
    return dict(process)


def ready_rule_worker(node: NodeProcess) -> dict[str, Any]:
    """The rule worker's process entry once it is registered again and idle."""

    def check() -> dict[str, Any] | None:
        status = node.status()
        registered = [w for w in status["workers"] if w["kind"] == "rules"]
        if status["all_ready"] and registered and registered[0]["state"] == "ready":
            return rule_worker(status)
        return None

    found: dict[str, Any] = wait_for(check, timeout=30)
    return found


def test_a_catastrophic_looking_regex_cannot_stall_the_rule_worker(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    node = make_node(workers={"count": 1}, fallback={"rules": rules_file(tmp_path)})
    before = ready_rule_worker(node)
    # The longest text the rules read at all (longer texts match no rule, by design).
    prompt = "hello " + "a" * (MAX_MATCH_CHARS - 7) + "!"
    assert len(prompt) == MAX_MATCH_CHARS
    reply = ask_rules(node, "long", prompt)
    assert reply["status"] == "ok", reply
    assert (reply["served_by"], reply["rule"]) == ("rules", "greeting")
    # The same shape, short, and a text the pattern does match.
    assert ask_rules(node, "short", "hello " + SHORT_ADVERSARIAL)["rule"] == "greeting"
    assert ask_rules(node, "match", "hello " + "a" * 5000)["rule"] == "redos"
    after = ready_rule_worker(node)
    assert (after["pid"], after["restarts"]) == (before["pid"], 0)


def test_a_request_that_kills_the_rule_worker_is_answered_once_and_not_retried(
    make_node: NodeFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The debug hook makes the rule engine hang on this text the way the backtracking regex
    # did before RE2 (on the old code, the regex itself hangs the worker on it).
    monkeypatch.setenv(HANG_ON_ENV, SHORT_ADVERSARIAL)
    node = make_node(workers={"count": 1}, fallback={"rules": rules_file(tmp_path)})
    first = ready_rule_worker(node)
    reply = ask_rules(node, "poison", SHORT_ADVERSARIAL)
    assert (reply["status"], reply["code"], reply["reason"]) == ("error", 503, "worker_lost")
    assert "not retried: the rule engine failed running this request" in reply["message"], reply
    # The restarted rule worker never got the request: one restart, and it answers others.
    restarted = ready_rule_worker(node)
    assert restarted["pid"] != first["pid"] and restarted["restarts"] == 1
    assert ask_rules(node, "next", "hello there")["rule"] == "greeting"
    assert rule_worker(node.status())["restarts"] == 1
    counters = node.status()["counters"]
    assert counters["worker_lost"] == 1


# --------------------------------------------------------------------------- start refuses


def _node_processes(run_dir: Path) -> list[int]:
    """Pids of processes of a node in ``run_dir``: by command line, or by environment (the
    background node is ``python -m node.cli start --foreground`` with EDGENODE_RUN_DIR)."""
    found = set(leftover_processes(run_dir))
    for proc in psutil.process_iter(["environ"]):
        try:
            if (proc.info["environ"] or {}).get("EDGENODE_RUN_DIR") == str(run_dir):
                found.add(proc.pid)
        except psutil.Error:
            continue
    found.discard(os.getpid())
    return sorted(found)


def test_start_with_a_bad_rules_file_refuses_with_the_check_message(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    bad = rules_file(
        tmp_path,
        '[[rule]]\nname = "look"\nregex = "(?<!not )on"\ntext = "x"\nconfidence = 1\n'
        '[[rule]]\nname = "open"\nregex = "(x"\ntext = "y"\nconfidence = 1\n',
    )
    node = make_node(start=False, workers={"count": 1}, fallback={"rules": bad})
    check = node.cli("rules", "check", bad)
    assert check.returncode == 1 and check.stderr.startswith(f"{bad}: 2 error(s)\n")
    try:
        started = node.cli("start", "--wait-s", "30")
        assert started.returncode != 0
        assert check.stderr.strip() in started.stderr  # the same words as `rules check`
        assert not (node.run_dir / "edgenode.pid").exists()
        assert node.cli("status").returncode == 3  # nothing answers
        assert _node_processes(node.run_dir) == []
    finally:
        for pid in _node_processes(node.run_dir):  # what the old code left running
            with_pid = psutil.Process(pid)
            with_pid.send_signal(signal.SIGKILL)
