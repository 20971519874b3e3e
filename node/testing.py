"""Start and stop a real edgenode process, for the integration and system tests and the
benchmarks in scripts/ (a module of the package, so that nothing edits ``sys.path``)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import psutil
import zmq

from broker.client import Client
from broker.errors import EdgeNodeError
from node.config import FRONTEND_SOCKET, from_dict
from node.endpoints import connect_endpoint
from node.interpreter import module_command
from node.sandbox.cgroupfs import Host
from node.sandbox.cgroups import cgroup_name
from node.sandbox.layout import read_layout
from node.security.keys import client_keys

REPO = Path(__file__).resolve().parent.parent

#: Fast heartbeats for tests and benchmarks (a dead worker found in ~0.3 s, not 3 s).
FAST_BROKER: dict[str, int] = {
    "heartbeat_interval_ms": 100,
    "heartbeat_liveness": 3,
    "stall_timeout_ms": 2000,
    "cancel_grace_ms": 1000,
}

#: Run in front of a node by ``NodeProcess.start`` (argv: the harness's pid, then
#: the node's command line): asks Linux to send this process SIGTERM when the
#: harness dies (prctl(2) PR_SET_PDEATHSIG = 1, kept across execve), then becomes
#: the node. The node runs in its own session, so without this a test or benchmark
#: killed with SIGKILL left it running; SIGTERM is its clean stop (workers ended,
#: cgroups removed). A wrapper, not ``preexec_fn``: that is unsafe once threads exist.
#: It drops ``sys.path[0]`` first: ``-c`` put the current directory there.
DIE_WITH_HARNESS = """\
import sys; del sys.path[0]
import ctypes, os, signal
if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG): " + os.strerror(ctypes.get_errno()))
if os.getppid() != int(sys.argv[1]):  # the harness died before prctl took effect
    sys.exit("the harness died before its node started")
os.execv(sys.argv[2], sys.argv[2:])
"""


#: Run in front of a command that a test stops with SIGINT (a Ctrl-C): resets SIGINT to
#: its default, then becomes the command. A shell running a job in the background
#: (``.ci/run &``) ignores SIGINT in it, children inherit an ignored signal across
#: execve, and Python then installs no KeyboardInterrupt handler: the Ctrl-C was lost.
DEFAULT_SIGINT = """\
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(sys.argv[1], sys.argv[1:])
"""


def with_default_sigint(argv: Sequence[str]) -> list[str]:
    """``argv`` run with SIGINT at its default disposition, whatever the caller's was
    (``DEFAULT_SIGINT``); ``argv[0]`` must be a path, as ``module_command`` gives."""
    return [sys.executable, "-c", DEFAULT_SIGINT, *argv]


def terminate(proc: subprocess.Popen[bytes], timeout: float, signalled: bool = False) -> int:
    """SIGTERM ``proc`` (its clean stop; not again when ``signalled``, already sent) and
    wait up to ``timeout`` s; past that, SIGKILL its whole process group. Returns its
    exit code."""
    if proc.poll() is None and not signalled:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def toml_value(value: Any) -> str:
    """A Python scalar as a TOML value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


class NodeProcess:
    """A node started with ``edgenode start --foreground`` in a private run dir.

    ``sections`` override the config: ``{"workers": {"engine": "test"}}``. The
    run dir is a short path under /tmp because ipc socket paths are limited to
    ~107 bytes.
    """

    def __init__(self, sections: dict[str, dict[str, Any]]) -> None:
        self.run_dir = Path(tempfile.mkdtemp(prefix="en-"))
        self.config = self.run_dir / "edgenode.toml"
        lines = []
        for name, values in sections.items():
            lines.append(f"[{name}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        self.config.write_text("\n".join(lines) + "\n")
        self.sections = sections
        configured = sections.get("node", {}).get("frontend")
        # Where a client connects: a wildcard bind (tcp://*:PORT) is no connect address.
        self.frontend = (
            connect_endpoint(configured)
            if configured
            else f"ipc://{self.run_dir / FRONTEND_SOCKET}"
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = self.run_dir / "node-stdout.log"
        #: SIGTERM sent by ``begin_stop``: ``stop`` only waits (a second SIGTERM is not needed).
        self._signalled = False

    def cli(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run ``edgenode ARGS`` against this node's config and run dir."""
        return subprocess.run(
            self._argv(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO
        )

    def _argv(self, *args: str) -> list[str]:
        return module_command(
            "node.cli",
            "-c",
            str(self.config),
            "--run-dir",
            str(self.run_dir),
            *args,
        )

    def start(self, timeout: float = 60, ready: bool = True) -> NodeProcess:
        """Start in the foreground mode as a child and wait for every worker READY
        (``ready=False``: only until the node answers ``status``).

        The node gets SIGTERM when this process dies, even by SIGKILL. Linux sends
        that signal when the *thread* that started the node exits, so only the
        main thread may start nodes.

        Raises:
            RuntimeError: called from another thread, or the node exited while starting.
            TimeoutError: not every worker READY within ``timeout`` seconds.
        """
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "start nodes from the main thread: a node is stopped when the thread "
                "that started it exits (PR_SET_PDEATHSIG follows the thread)"
            )
        self._signalled = False
        cmd = [sys.executable, "-c", DIE_WITH_HARNESS, str(os.getpid())]
        cmd += self._argv("start", "--foreground")
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=out, cwd=REPO, start_new_session=True
            )
        self.wait_ready(timeout, all_ready=ready)
        return self

    def wait_ready(self, timeout: float = 60, all_ready: bool = True) -> dict[str, Any]:
        """Poll ``status`` until every worker is ready (``all_ready=False``: until
        the node answers); returns that status."""
        deadline = time.monotonic() + timeout
        with self.client(wait_ms=500) as client:
            while time.monotonic() < deadline:
                if self.proc is not None and self.proc.poll() is not None:
                    raise RuntimeError(f"node exited: {self.log.read_text()[-3000:]}")
                try:
                    status = client.status()
                    if status.get("all_ready") or not all_ready:
                        return status
                except EdgeNodeError:
                    pass
                time.sleep(0.05)
        raise TimeoutError(f"node not ready in {timeout}s: {self.log.read_text()[-3000:]}")

    def client(self, **kwargs: Any) -> Client:
        """A client connected to this node (with the node's local CURVE key if its
        frontend has CURVE, unless ``kwargs`` name keys)."""
        if "server_public_key" not in kwargs:
            kwargs.update(self.keys())
        return Client(self.frontend, **kwargs)

    def keys(self) -> dict[str, Any]:
        """The ``Client`` keywords of a process of this host (``client_keys``)."""
        return client_keys(from_dict(self.sections).security, self.run_dir)

    def status(self) -> dict[str, Any]:
        """The node's status map."""
        with self.client(wait_ms=2000) as c:
            return c.status()

    def worker_pids(self) -> list[int]:
        """Pids of the live worker processes, from status."""
        return [p["pid"] for p in self.status()["processes"] if p["pid"]]

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM the node and wait; returns its exit code."""
        assert self.proc is not None
        return terminate(self.proc, timeout, signalled=self._signalled)

    def begin_stop(self) -> None:
        """SIGTERM the node without waiting for it: ``stop`` or ``cleanup`` waits later, so
        a test suite can stop one node while the next test starts its own."""
        if self.proc is not None and self.proc.poll() is None and not self._signalled:
            self.proc.send_signal(signal.SIGTERM)
            self._signalled = True

    def stopped(self) -> bool:
        """Not running (never started, or exited)."""
        return self.proc is None or self.proc.poll() is not None

    def cleanup(self) -> None:
        """Kill anything left (a failed test must not leak processes) and remove the run dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        for pid in node_processes(self.run_dir):  # started by `edgenode start`: stop cleanly
            with contextlib.suppress(psutil.Error):
                proc = psutil.Process(pid)
                proc.terminate()
                proc.wait(30)
        for pid in leftover_processes(self.run_dir):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, every: float = 0.02) -> Any:
    """Poll until ``predicate()`` is truthy; returns its value or fails the test."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"condition not met within {timeout}s")


def leftover_processes(run_dir: Path) -> list[int]:
    """Pids of any process whose command line mentions ``run_dir``, or that runs
    with ``EDGENODE_RUN_DIR=run_dir`` (a node started by ``edgenode start`` in the
    background has the run directory only in its environment)."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        try:
            mentions = str(run_dir) in " ".join(proc.info["cmdline"] or [])
            if mentions or proc.environ().get("EDGENODE_RUN_DIR") == str(run_dir):
                found.append(proc.pid)
        except psutil.Error:
            continue
    return found


def node_processes(run_dir: Path) -> list[int]:
    """Pids of the node processes (``edgenode start --foreground``) serving ``run_dir``."""
    found = []
    for pid in leftover_processes(run_dir):
        try:
            proc = psutil.Process(pid)
            cmdline = proc.cmdline()
            if "node.cli" in cmdline and "--foreground" in cmdline and proc.status() != "zombie":
                found.append(pid)
        except psutil.Error:
            continue
    return found


def cgroups_usable(host: Host | None = None) -> bool:
    """True when this process is root and ``host`` (this machine's by default) has a
    cgroup hierarchy the sandbox can use (a v1 memory controller or a v2 mount): what a
    test with ``sandbox = "required"`` needs. An unreadable /proc file counts as no."""
    if os.geteuid() != 0:
        return False
    try:
        layout = read_layout(host or Host())
    except OSError:
        return False
    return "memory" in layout.v1 or layout.v2 is not None


def node_cgroup_dirs(run_dir: Path) -> list[Path]:
    """The node's cgroup trees that exist now, in every hierarchy of this host."""

    layout = read_layout(Host())
    name = cgroup_name(run_dir)
    dirs = {m.dir_of(layout.own_v1.get(c, "/")) / name for c, m in layout.v1.items()}
    if layout.v2 is not None:
        dirs.add(layout.v2.dir_of(layout.own_v2 or "/") / name)
    return sorted(d for d in dirs if d.is_dir())


class Collector:
    """A raw DEALER that sends requests and keeps every reply, to check that each
    accepted request got exactly one final reply (and nothing after it)."""

    def __init__(self, endpoint: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.replies: dict[Any, list[dict[str, Any]]] = {}
        self.sent: list[Any] = []

    def send(self, **body: Any) -> None:
        """Send one request body (must carry ``id``)."""
        self.sent.append(body["id"])
        self.sock.send_multipart([b"", b"EDGE/C1", msgpack.packb(body)])

    def finals(self) -> dict[Any, list[dict[str, Any]]]:
        """Final (non-partial) replies by id."""
        return {k: [r for r in v if r["status"] != "partial"] for k, v in self.replies.items()}

    def final(self, rid: Any) -> dict[str, Any]:
        """The one final reply of ``rid`` (asserts there is exactly one)."""
        # One id's replies only: calling finals() per id made checking a flood O(n²).
        finals = [r for r in self.replies.get(rid, []) if r["status"] != "partial"]
        assert len(finals) == 1, (rid, self.replies.get(rid))
        return finals[0]

    def collect(
        self, until_all_final: bool = True, timeout: float = 10.0, linger: float = 0.3
    ) -> None:
        """Read replies until every sent id has a final (or timeout), then keep
        reading ``linger`` seconds more to catch duplicates."""
        deadline = time.monotonic() + timeout
        done_at: float | None = None
        # Ids still without a final, kept as replies arrive: checking every id's
        # replies per reply made a flood of a thousand requests take minutes.
        open_ids = {i for i in self.sent if not self.finals_of(i)}
        while True:
            now = time.monotonic()
            if done_at is None and (now > deadline or (until_all_final and not open_ids)):
                done_at = now
            if done_at is not None and now > done_at + linger:
                return
            if self.sock.poll(20):
                frames = self.sock.recv_multipart()
                body = msgpack.unpackb(frames[-1])
                self.replies.setdefault(body.get("id"), []).append(body)
                if body.get("status") != "partial":
                    open_ids.discard(body.get("id"))

    def finals_of(self, rid: Any) -> list[dict[str, Any]]:
        """The final (non-partial) replies of ``rid`` so far."""
        return [r for r in self.replies.get(rid, []) if r["status"] != "partial"]

    def assert_exactly_one_final_each(self) -> None:
        """Every sent id has exactly one final reply and no reply after it."""
        for rid in self.sent:
            replies = self.replies.get(rid, [])
            finals = [i for i, r in enumerate(replies) if r["status"] != "partial"]
            assert len(finals) == 1, (rid, replies)
            assert finals[0] == len(replies) - 1, ("reply after final", rid, replies)

    def close(self) -> None:
        """Close the socket at once (LINGER 0: unsent requests are dropped)."""
        self.sock.close(0)


def ask_rules(node: NodeProcess, rid: str, prompt: str, timeout_ms: int = 20_000) -> dict[str, Any]:
    """One ``route: rules`` generate with a raw DEALER; asserts exactly one final
    reply came, and returns it."""
    col = Collector(node.frontend)
    try:
        col.send(id=rid, op="generate", prompt=prompt, route="rules", timeout_ms=timeout_ms)
        col.collect(timeout=timeout_ms / 1000 + 10, linger=0.5)
        col.assert_exactly_one_final_each()
        return col.final(rid)
    finally:
        col.close()


def grep_json(path: Path, needle: str) -> list[dict[str, Any]]:
    """The lines of the log ``path`` that contain ``needle`` (``grep needle path``),
    each parsed as JSON (``[logging] format = "json"``); [] if there is no file yet.

    Raises:
        json.JSONDecodeError: a matching line is not JSON.
    """
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if needle in line]


class AgentProcess:
    """A host agent (``edgenode worker --connect``) started as a real process, in a
    private run dir (its own cgroups and pidfile), for a gateway ``NodeProcess``.

    ``sections`` are its config (``{"workers": {"engine": "test"}}``); ``name`` is
    its worker ids' prefix; ``extra``: more ``edgenode worker`` options (``--key``,
    ``--server-key``). Like ``NodeProcess``, it gets SIGTERM when the harness dies.
    """

    def __init__(
        self,
        connect: str,
        name: str,
        sections: dict[str, dict[str, Any]],
        extra: Sequence[str] = (),
    ) -> None:
        self.connect = connect
        self.name = name
        self.extra = list(extra)
        self.run_dir = Path(tempfile.mkdtemp(prefix="ea-"))
        self.config = self.run_dir / "agent.toml"
        lines = []
        for section, values in sections.items():
            lines.append(f"[{section}]")
            lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        self.config.write_text("\n".join(lines) + "\n")
        self.log = self.run_dir / "agent.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> AgentProcess:
        """Start the agent (from the main thread, as ``NodeProcess.start``)."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("start agents from the main thread (PR_SET_PDEATHSIG)")
        argv = module_command(
            "node.cli", "--run-dir", str(self.run_dir), "worker",
            "--connect", self.connect, "--name", self.name, "-c", str(self.config), *self.extra,
        )  # fmt: skip
        cmd = [sys.executable, "-c", DIE_WITH_HARNESS, str(os.getpid()), *argv]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=out, cwd=REPO, start_new_session=True
            )
        return self

    def registered(self, node: NodeProcess, count: int, timeout: float = 30) -> list[Any]:
        """Wait until ``count`` of this agent's workers are registered with ``node``;
        returns their status entries.

        Raises:
            RuntimeError: the agent exited meanwhile (its log's tail says why).
        """

        def mine() -> list[Any] | None:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"agent exited: {self.log.read_text()[-3000:]}")
            found = [w for w in node.status()["workers"] if w.get("host") == self.name]
            return found if len(found) >= count else None

        result: list[Any] = wait_for(mine, timeout=timeout, every=0.05)
        return result

    def worker_pids(self) -> list[int]:
        """Pids of the agent's worker processes (its children)."""
        if self.proc is None:
            return []
        with contextlib.suppress(psutil.Error):
            return [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        return []

    def kill9(self) -> None:
        """SIGKILL the agent and every worker of it at once: a board losing power."""
        assert self.proc is not None
        victims = [self.proc.pid, *self.worker_pids()]
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM the agent and wait; returns its exit code."""
        assert self.proc is not None
        return terminate(self.proc, timeout)

    def cleanup(self) -> None:
        """Kill anything left, remove the cgroups a killed agent left, and the run dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.stop()
        for pid in leftover_processes(self.run_dir):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
        for top in node_cgroup_dirs(self.run_dir):  # after kill -9: empty now, deepest first
            for d in sorted(top.rglob("*"), key=lambda p: len(p.parts), reverse=True):
                if d.is_dir():
                    with contextlib.suppress(OSError):
                        d.rmdir()
            with contextlib.suppress(OSError):
                top.rmdir()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def free_port() -> int:
    """A TCP port nobody listens on at 127.0.0.1 right now (the kernel's pick; another
    process may take it before the caller binds it, as with any such pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
