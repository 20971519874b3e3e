"""The processes a node starts, started for real: what they import and the
descriptors they may open.

Finding A: the node and its workers ran as ``python -m ...``, so Python put the
directory the node was started in first on ``sys.path``: a ``broker.py`` there
replaced the broker, a ``fallback/`` package there crash-looped the rule worker.
Finding C: the node kept the soft open-files limit it was started with (often
1024), and an ipc:// frontend aborts inside libzmq when the descriptors run out.
"""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from node.testing import NodeProcess, ask_rules, node_processes

NodeFactory = Callable[..., NodeProcess]

ONE_WORKER = {"count": 1, "slots": 1}

RULES = """\
[[rule]]
name = "greeting"
any = ["hello"]
text = "hi"
confidence = 1
"""


def poisoned_cwd(path: Path) -> Path:
    """A directory whose ``broker`` and ``fallback`` shadow the package's, if imported."""
    path.mkdir()
    (path / "broker.py").write_text('raise RuntimeError("broker.py of the cwd imported")\n')
    (path / "fallback").mkdir()
    (path / "fallback" / "__init__.py").write_text(
        'raise RuntimeError("fallback/ of the cwd imported")\n'
    )
    (path / "rules.toml").write_text(RULES)
    return path


def test_a_node_started_in_a_directory_of_lookalike_modules_imports_its_own(
    make_node: NodeFactory, tmp_path: Path
) -> None:
    cwd = poisoned_cwd(tmp_path / "cwd")
    # A relative rules path: the node still resolves it against the directory it starts in.
    node = make_node(start=False, workers=ONE_WORKER, fallback={"rules": "rules.toml"})
    started = subprocess.run(
        node._argv("start", "--wait-s", "60"), capture_output=True, text=True, cwd=cwd
    )
    assert started.returncode == 0, started.stderr
    assert "of the cwd imported" not in started.stderr
    with node.client(wait_ms=20_000) as client:
        reply = client.generate("hello", max_tokens=4, route="llm")
    assert reply.served_by == "llm", reply.raw
    ruled = ask_rules(node, "r1", "hello there")
    assert (ruled["status"], ruled["served_by"], ruled["rule"]) == ("ok", "rules", "greeting")
    logs = "".join(p.read_text(errors="replace") for p in node.run_dir.rglob("*.log"))
    assert "of the cwd imported" not in logs


def limits_of(pid: int) -> tuple[int, int]:
    """The soft and hard "Max open files" in /proc/PID/limits."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError(f"no open files limit in /proc/{pid}/limits")


def test_a_node_raises_its_soft_open_files_limit_to_the_hard_one(make_node: NodeFactory) -> None:
    node = make_node(start=False, workers=ONE_WORKER)
    hard = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    low = (
        "import os, resource, sys; "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (256, {hard})); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    started = subprocess.run(
        [sys.executable, "-c", low, *node._argv("start", "--wait-s", "60")],
        capture_output=True,
        text=True,
    )
    assert started.returncode == 0, started.stderr
    [pid] = node_processes(node.run_dir)
    assert limits_of(pid) == (hard, hard)
    for worker in node.worker_pids():
        assert limits_of(worker) == (hard, hard)
