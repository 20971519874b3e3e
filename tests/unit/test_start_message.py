"""``edgenode start``'s last line counts who is ready from ``status``'s ``workers``
(``node.cli.main._Ready``): model workers, the rule worker apart (a new user read
"2 worker(s) ready" for a node of one model worker), remote agents' apart."""

from __future__ import annotations

from node.cli.main import _Ready


def test_the_rule_worker_and_remote_workers_are_not_counted_as_model_workers() -> None:
    workers = [
        {"worker_id": "llm-0", "kind": "llm", "remote": False},
        {"worker_id": "rules-0", "kind": "rules", "remote": False},
        {"worker_id": "pi.llm-0", "kind": "llm", "remote": True},
    ]
    ready = _Ready.of(workers)
    assert ready == _Ready(model=1, rules=1, remote=1)
    assert str(ready) == "1 model worker(s) ready, the rule worker too (and 1 remote)"


def test_a_node_without_rules_says_its_model_workers_alone() -> None:
    workers = [{"worker_id": f"llm-{i}", "kind": "llm", "remote": False} for i in range(2)]
    assert str(_Ready.of(workers)) == "2 model worker(s) ready"
