"""A node embedded in an app (``with Node(config)``, ``async with``) leaves nothing behind.

Each test runs tests/embed_app.py as a real separate process: it installs its own
SIGTERM/SIGINT handlers, embeds a node, serves requests through the sync Client (the
AsyncClient under ``async with``) and exits. The app checks from inside (its handlers
while the node serves, its cgroup, a second node on the same run directory) and writes a
report; this test then checks from outside that nothing is left: no worker process (by
pid and by process group), no cgroup of the node, no socket file, no pidfile, and the
app's handlers and cgroup as they were. Test engine, 100 ms heartbeats x 3.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from node.interpreter import module_command
from node.model import RULES_SNAPSHOT
from node.testing import REPO, leftover_processes, node_cgroup_dirs, toml_value, wait_for

APP = REPO / "tests" / "embed_app.py"

GREETING_RULES = """\
[[rule]]
name = "greeting"
any = ["hello"]
text = "hi"
confidence = 1
"""


class App:
    """One run of tests/embed_app.py in a private run directory."""

    def __init__(self, run_dir: Path, **sections: dict[str, Any]) -> None:
        self.run_dir = run_dir
        merged: dict[str, dict[str, Any]] = {
            "node": {"run_dir": str(run_dir)},
            "workers": {"engine": "test", "count": 2, "slots": 1, "threads": 1},
            "broker": {
                "heartbeat_interval_ms": 100,
                "heartbeat_liveness": 3,
                "stall_timeout_ms": 2000,
                "cancel_grace_ms": 1000,
            },
            "fallback": {"rules": ""},
            "pressure": {"cpu_warn_pct": 0.0},
        }
        for name, values in sections.items():
            merged.setdefault(name, {}).update(values)
        lines = []
        for name, values in merged.items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        self.config = run_dir / "app.toml"
        self.config.write_text("\n".join(lines) + "\n")
        self.report_path = run_dir / "report.json"

    def run(self, mode: str, **env_extra: str) -> tuple[int, dict[str, Any], str]:
        """Run the app to its end: (exit code, its report, its stderr)."""
        done = subprocess.run(
            self._argv(mode),
            cwd=REPO,
            env=self._env(**env_extra),
            capture_output=True,
            text=True,
            timeout=50,
        )
        report = json.loads(self.report_path.read_text())
        return done.returncode, report, done.stderr

    def spawn(self, mode: str) -> subprocess.Popen[str]:
        """Start the app (stdin and stdout piped, stderr to ``self.stderr``) and
        wait for its "serving" line."""
        self.stderr = self.run_dir / "app.stderr"
        with self.stderr.open("w") as err:
            proc = subprocess.Popen(
                self._argv(mode),
                cwd=REPO,
                env=self._env(),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line == "serving\n", (line, self.stderr.read_text())
        return proc

    def finish(self, proc: subprocess.Popen[str]) -> tuple[int, dict[str, Any], str]:
        """Wait for a spawned app's end: (exit code, its report, its stderr)."""
        code = proc.wait(timeout=40)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                pipe.close()
        return code, json.loads(self.report_path.read_text()), self.stderr.read_text()

    def _argv(self, mode: str) -> list[str]:
        return [sys.executable, str(APP), str(self.config), str(self.report_path), mode]

    def _env(self, **extra: str) -> dict[str, str]:
        env = {**os.environ, "PYTHONPATH": str(REPO), **extra}
        env.pop("EDGENODE_RUN_DIR", None)  # the config's run_dir, not the harness's
        return env

    def assert_nothing_left(self, report: dict[str, Any], stopped_in_main: bool = True) -> None:
        """No worker process (by pid, by process group), cgroup, socket file or
        pidfile; the app's handlers and cgroup as they were (the cgroup only when
        the app's main stopped the node before writing its report)."""
        pids = set(report.get("workers", {}).values()) | set(
            report.get("workers_after_kill", {}).values()
        )
        assert not [pid for pid in pids if _is_worker(pid)], pids
        groups = [p.pid for p in psutil.process_iter() if _pgid(p.pid) in pids]
        assert groups == [], f"processes left in the workers' groups: {groups}"
        assert leftover_processes(self.run_dir) == []
        assert node_cgroup_dirs(self.run_dir) == []
        cgroup = report.get("sandbox", {}).get("cgroup")
        assert cgroup is None or not Path(cgroup).exists()
        for name in ("frontend.sock", "workers/backend.sock", "edgenode.pid", RULES_SNAPSHOT):
            assert not (self.run_dir / name).exists(), name
        assert not list(self.run_dir.rglob("*.sock"))
        if stopped_in_main:
            assert report["cgroup_after"] == report["cgroup_before"]
        assert report["handlers_after"] == report["handlers_before"]
        assert report["wakeup_fd_after"] == report["wakeup_fd_before"] == -1
        assert "on_signal" in report["handlers_before"]["SIGTERM"]  # the app's own

    def assert_served_from_its_cgroup(self, report: dict[str, Any]) -> None:
        """The handlers were the app's while the node served; with a sandbox the
        node had its cgroup and the app was in the node's leaf (documented)."""
        assert report["handlers_inside"] == report["handlers_before"]
        if report["sandbox"]["backend"] != "none":
            assert report["node_cgroup_existed"] is True
            assert report["cgroup_inside"] != report["cgroup_before"]
            assert "/node\n" in report["cgroup_inside"]


def _is_worker(pid: int) -> bool:
    try:
        proc = psutil.Process(pid)
        return proc.status() != psutil.STATUS_ZOMBIE and "node.worker" in " ".join(proc.cmdline())
    except psutil.Error:
        return False


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


@pytest.fixture
def app_dir() -> Iterator[Path]:
    """A short run directory (ipc paths are limited to ~107 bytes); whatever a
    failed run left is killed and removed."""
    run_dir = Path(tempfile.mkdtemp(prefix="en-"))
    yield run_dir
    for pid in leftover_processes(run_dir):
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).kill()
    shutil.rmtree(run_dir, ignore_errors=True)


def test_with_node_serves_and_leaves_nothing(app_dir: Path) -> None:
    app = App(app_dir)
    code, report, stderr = app.run("sync")
    assert code == 0, report.get("error", stderr)
    assert report["replies"] == ["echo: hello 0", "echo: hello 1", "echo: hello 2"]
    assert report["frontend"] == f"ipc://{app_dir}/frontend.sock"
    assert report["running_after_stop"] is False  # stopped twice in the body, once by with
    # A SIGKILLed worker is noticed without SIGCHLD: re-dispatched, restarted.
    kill9 = report["kill9"]
    assert kill9["status"] == "ok" and kill9["text"] == "echo: !slow 100 a b c d e f"
    assert kill9["served_by"] != kill9["victim"]
    assert kill9["last_exit"] == "killed by SIGKILL"
    assert report["workers_after_kill"][kill9["victim"]] != report["workers"][kill9["victim"]]
    # The pidfile names the app, as it names the CLI's node, and says it embeds
    # the node. A second node in the same process is refused (one per process;
    # test_a_second_node_in_the_process_is_refused, from another process
    # test_stop_and_a_second_node_name_the_app_that_embeds_the_node).
    assert report["pidfile_inside"]["pid"] == report["pid"]
    assert report["pidfile_inside"]["embedded"] is True
    assert "one edgenode node per process" in report["second_node"]
    assert f"pid {report['pid']}" in report["second_node"]
    app.assert_served_from_its_cgroup(report)
    app.assert_nothing_left(report)


@pytest.mark.parametrize("cpus", ["auto", [1]], ids=["default-auto", "listed"])
def test_only_a_listed_reservation_moves_the_apps_threads(
    app_dir: Path, cpus: str | list[int]
) -> None:
    """The default "auto" reserves cores for the workers and leaves the app's threads
    (the embedded broker's) where they were; listed cores pin them there until stop,
    which gives each its own cores back (a thread the app pinned to core 0 came back
    on every core: all got the starting thread's)."""
    allowed = sorted(os.sched_getaffinity(0))
    if not {0, 1} <= set(allowed):
        pytest.skip(f"needs cores 0 and 1; this process may use {allowed}")
    code, report, stderr = App(app_dir, workers={"cpus": cpus}).run("sync")
    assert code == 0, report.get("error", stderr)
    reserved = allowed[1:] if cpus == "auto" else [1]
    assert report["cores"]["workers"] == reserved and report["cores"]["reserved"] is True
    assert report["affinity_before"] == report["affinity_after"] == allowed
    assert report["held_before"] == report["held_after"] == [0]
    if cpus == "auto":
        assert report["cores"]["node"] == [] and report["affinity_inside"] == allowed
        assert report["held_inside"] == [0]
    else:
        assert report["cores"]["node"] == [1] and report["affinity_inside"] == [1]
        assert report["held_inside"] == [1]


def test_a_body_that_raises_still_leaves_nothing(app_dir: Path) -> None:
    app = App(app_dir)
    code, report, stderr = app.run("raise")
    assert code == 3, report.get("error", stderr)
    assert report["raised"] == "the app's body failed"
    assert report["replies"] == ["echo: hello 0", "echo: hello 1", "echo: hello 2"]
    app.assert_served_from_its_cgroup(report)
    app.assert_nothing_left(report)


def test_with_node_rules_only(app_dir: Path) -> None:
    rules = app_dir / "rules.toml"
    rules.write_text(GREETING_RULES)
    app = App(app_dir, workers={"count": 0}, fallback={"rules": str(rules)})
    code, report, stderr = app.run("rules")
    assert code == 0, report.get("error", stderr)
    assert report["replies"] == ["hi", "rules"]
    assert set(report["workers"]) == {"rules-0"}
    app.assert_served_from_its_cgroup(report)
    app.assert_nothing_left(report)


def test_async_with_node_never_blocks_the_event_loop(app_dir: Path) -> None:
    app = App(app_dir)
    code, report, stderr = app.run("async")
    assert code == 0, report.get("error", stderr)
    assert report["replies"] == ["echo: a0", "echo: a1", "echo: a2"]
    # The ticker (every 5 ms) kept running while the node started (its workers
    # had to spawn and register) and while it stopped (they had to exit).
    assert report["ticks_during_start"] >= 3
    assert report["ticks_during_stop"] >= 1
    app.assert_served_from_its_cgroup(report)
    app.assert_nothing_left(report)


def test_a_start_that_times_out_says_why_and_leaves_nothing(app_dir: Path) -> None:
    # 5 s to load the test model: no worker is READY within the 0.3 s the app waits.
    app = App(app_dir, workers={"test_load_ms": 5000})
    code, report, stderr = app.run("timeout")
    assert code == 0, report.get("error", stderr)
    assert "body_ran" not in report
    assert "not every worker READY within 0.3 s" in report["start_error"]
    app.assert_nothing_left(report)


def test_a_node_never_stopped_stops_when_the_app_ends(app_dir: Path) -> None:
    # The app starts a node and returns from main without stop(): the interpreter
    # waits for the loop thread, which sees the main thread gone and stops cleanly.
    app = App(app_dir)
    code, report, stderr = app.run("forget")
    assert code == 0, report.get("error", stderr)
    assert report["replies"] == ["echo: hello"]
    assert "main thread ended without stopping its node" in stderr
    assert "edgenode stopped" in stderr
    app.assert_nothing_left(report, stopped_in_main=False)


def test_a_task_cancelled_while_its_node_starts_leaves_nothing(app_dir: Path) -> None:
    # wait_for cancels the task 0.3 s into a start that takes 2 s (the test model's
    # load): __aenter__ lets the start finish in its thread, then stops the node.
    app = App(app_dir, workers={"test_load_ms": 2000})
    code, report, stderr = app.run("async-cancel")
    assert code == 0, report.get("error", stderr)
    assert report["cancelled"] is True
    assert "body_ran" not in report
    assert "edgenode stopped" in stderr
    app.assert_nothing_left(report)


def test_a_second_node_in_the_process_is_refused(app_dir: Path) -> None:
    # Each node moves the whole process into its own "node" leaf cgroup: a second
    # one made its cgroups inside the first's, and the first's stop killed its
    # workers. One node per process: the second start is refused, makes nothing,
    # and the first serves on and stops clean.
    second_dir = app_dir / "second"
    second_dir.mkdir()
    second = App(second_dir)
    app = App(app_dir)
    code, report, stderr = app.run("two", EDGENODE_CONFIG2=str(second.config))
    assert code == 0, report.get("error", stderr)
    assert report["second_node"].startswith("one edgenode node per process: the node of ")
    assert f"still runs in this process (pid {report['pid']})" in report["second_node"]
    assert report["replies"] == ["echo: hello"]
    assert node_cgroup_dirs(second_dir) == []
    assert leftover_processes(second_dir) == []
    assert not (second_dir / "edgenode.pid").exists()
    assert "SandboxError" not in stderr
    app.assert_nothing_left(report)


def test_stop_and_a_second_node_name_the_app_that_embeds_the_node(app_dir: Path) -> None:
    # From outside, the run directory's lock holder is the app: edgenode stop says
    # a node is embedded there (and signals nothing), status shows it serving, and
    # a second node (another process) is refused naming the app as an embedding.
    app = App(app_dir)
    proc = app.spawn("hold")
    try:
        base = [*module_command("node.cli", "-c", str(app.config), "--run-dir", str(app_dir))]
        env = app._env()

        def cli(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [*base, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=30
            )

        stopped = cli("stop")
        assert stopped.returncode == 1, stopped
        assert (
            f"the edgenode node of {app_dir} is embedded in an app (pid {proc.pid}: "
            in stopped.stderr
        )
        assert "the app stops it (Node.stop(), or the end of its with block)" in stopped.stderr
        assert "nothing was signalled" in stopped.stderr
        assert "not an edgenode node" not in stopped.stderr
        status = cli("status", "--json")
        assert status.returncode == 0, status
        assert json.loads(status.stdout)["pid"] == proc.pid
        second = subprocess.run(
            [sys.executable, "-c", SECOND_NODE, str(app.config)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.stdout.startswith(
            f"ConfigError: edgenode already running, embedded in an app (pid {proc.pid}: "
        ), second
        assert proc.poll() is None  # nothing signalled it
    finally:
        assert proc.stdin is not None
        proc.stdin.write("done\n")
        proc.stdin.flush()
    code, report, stderr = app.finish(proc)
    assert code == 0, report.get("error", stderr)
    app.assert_nothing_left(report)


#: A second process that starts a node on the config in argv[1]; prints the error.
SECOND_NODE = """\
import sys
from broker.errors import ConfigError
from node.app import Node
from node.config import load_config
try:
    Node(load_config(sys.argv[1])).start()
    print("started")
except ConfigError as exc:
    print(f"ConfigError: {exc.message}")
"""


def test_more_ctrl_cs_during_the_stop_do_not_cut_it_short(app_dir: Path) -> None:
    # A Ctrl-C stops the node; the drain waits for a 4 s request, and more Ctrl-Cs
    # come meanwhile. On Python 3.11 one inside Thread.join made is_alive() False
    # while the loop thread still ran: the stop returned early, the app stayed in
    # the node's cgroup, and a worker, the pidfile and the sockets were left.
    app = App(app_dir, workers={"stop_grace_ms": 10_000})
    proc = app.spawn("ctrlc")
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: "draining 1 request" in app.stderr.read_text(), timeout=10)
    for _ in range(3):
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
    assert proc.poll() is None  # still stopping: the Ctrl-Cs came during the stop
    code, report, stderr = app.finish(proc)
    assert code == 0, report.get("error", stderr)
    assert report["interrupted"] is True
    assert "loop thread failed" not in stderr
    assert "edgenode stopped" in stderr
    app.assert_nothing_left(report)
