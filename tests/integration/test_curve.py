"""CURVE on a real node (test engine) on loopback TCP: Ironhouse on the frontend
and the backend, refusals counted, per-client caps by key, plaintext refused
where other hosts could reach it.

The node's keypair is made by ``edgenode keys generate`` (the CLI the operator
uses; the others by the function behind it, a subprocess each costs ~2 s here)
and the clients' are allowed by ``edgenode keys allow``, once for the module: each
test runs on its own copy of those files.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from broker import protocol as p
from broker.client import Client
from broker.errors import Overloaded, Unavailable
from broker.refusal_log import FIRST_KEYS
from node.engine import EngineSpec
from node.interpreter import module_command
from node.security.keys import generate
from node.testing import REPO, NodeProcess, free_port, wait_for
from node.worker import WorkerSpec

NodeFactory = Callable[..., NodeProcess]

#: One light worker: the test engine, one slot.
ONE_WORKER = {"count": 1, "slots": 1}
#: How long a refused client waits for a reply before ``Unavailable`` (ms).
REFUSED_WAIT_MS = 1500


def edgenode(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the ``edgenode`` CLI of this tree without a config."""
    return subprocess.run(
        module_command("node.cli", *args), capture_output=True, text=True, timeout=60, cwd=REPO
    )


@dataclass
class Keys:
    """Key files of one test: the node's two keypairs, the allowlists, and clients'."""

    root: Path
    #: Where the allowlists to copy are (``made_once``'s ``clients`` and ``workers``).
    allowlists: Path | None = None

    def generate(self, name: str, cli: bool = False) -> Path:
        """NAME's keypair (``edgenode keys generate --dir ROOT NAME`` if ``cli``);
        returns NAME.key_secret."""
        if cli:
            made = edgenode("keys", "generate", "--dir", str(self.root), name)
            assert made.returncode == 0, made.stderr
            assert "NAME.key_secret" not in made.stdout and name in made.stdout
        else:
            generate(self.root, name)
        return self.root / f"{name}.key_secret"

    def pair(self, name: str) -> tuple[bytes, bytes]:
        """NAME's (public, secret) keys, Z85."""
        public, secret = zmq.auth.load_certificate(self.root / f"{name}.key_secret")
        assert secret is not None
        return public, secret

    def public(self, name: str) -> bytes:
        """NAME's public key, Z85."""
        return self.pair(name)[0]


#: Allowed with ``edgenode keys allow`` into every curve node's allowlists: (name, flags).
ALLOWED = (("alice", ()), ("bob", ()), ("agent", ("--worker",)))


@pytest.fixture(scope="module")
def made_once(tmp_path_factory: pytest.TempPathFactory, make_module_node: NodeFactory) -> Path:
    """The module's key files and allowlists, made once with the operator's CLI (the node's
    keypair with ``edgenode keys generate``, ``ALLOWED`` with ``edgenode keys allow``):
    each CLI run costs seconds, and every test here needs the same files. Each test gets
    a copy of them (``keys``, ``curve_node``), which it may spoil."""
    root = tmp_path_factory.mktemp("curve")
    made = Keys(root / "keys")
    made.generate("node", cli=True)
    for name in ("backend", "alice", "bob", "mallory", "agent", "stranger"):
        made.generate(name)
    lists = make_module_node(
        start=False,
        security={
            "server_secret_key": str(made.root / "node.key_secret"),
            "client_keys": str(root / "clients"),
            "backend_secret_key": str(made.root / "backend.key_secret"),
            "worker_keys": str(root / "workers"),
        },
    )
    for name, flag in ALLOWED:
        allowed = lists.cli("keys", "allow", str(made.root / f"{name}.key"), *flag)
        assert allowed.returncode == 0, allowed.stderr
    return root


@pytest.fixture
def keys(made_once: Path, tmp_path: Path) -> Iterator[Keys]:
    """This test's copy of the module's key files (modes kept: secrets 0600)."""
    shutil.copytree(made_once / "keys", tmp_path / "keys")
    yield Keys(tmp_path / "keys", allowlists=made_once)


def curve_node(
    make_node: NodeFactory,
    keys: Keys,
    tmp_path: Path,
    start: bool = True,
    **sections: dict[str, Any],
) -> NodeProcess:
    """A node with CURVE on a loopback TCP frontend and backend; alice and bob are
    allowed clients, agent an allowed worker (a copy of the allowlists ``made_once``
    made with ``edgenode keys allow``); started unless ``start`` is False."""
    assert keys.allowlists is not None
    for allowlist in ("clients", "workers"):
        shutil.copytree(keys.allowlists / allowlist, tmp_path / allowlist)
    security = {
        "server_secret_key": str(keys.root / "node.key_secret"),
        "client_keys": str(tmp_path / "clients"),
        "backend_secret_key": str(keys.root / "backend.key_secret"),
        "worker_keys": str(tmp_path / "workers"),
    }
    sections = {"workers": dict(ONE_WORKER), **sections}
    node = make_node(
        start=False,
        node={
            "frontend": f"tcp://127.0.0.1:{free_port()}",
            "backend": f"tcp://127.0.0.1:{free_port()}",
        },
        security=security,
        **sections,
    )
    return node.start() if start else node


def client(node: NodeProcess, keys: Keys, name: str, server: str = "node", **kw: Any) -> Client:
    """A client holding NAME's keypair that trusts SERVER's public key."""
    return Client(
        node.frontend, server_public_key=keys.public(server), client_keypair=keys.pair(name), **kw
    )


def refused(node: NodeProcess, side: str, cause: str) -> int:
    """The node's count of CURVE handshakes refused on ``side`` for ``cause``."""
    count: int = node.status()["refused"][side][cause]
    return count


def test_an_allowed_client_is_served_and_knows_the_node_is_secured(
    make_node: NodeFactory, keys: Keys, tmp_path: Path
) -> None:
    node = curve_node(make_node, keys, tmp_path)
    with client(node, keys, "alice", wait_ms=5000) as alice:
        reply = alice.generate("hello there", max_tokens=4)
        assert (reply.text, reply.served_by) == ("echo: hello there", "llm")
        status = alice.status()
    assert status["security"] == {"frontend": "curve", "backend": "curve"}
    assert status["refused"]["frontend"] == {"key_not_allowed": 0, "handshake_failed": 0}
    # The node's own worker got in on the CURVE backend with the node's local key.
    assert [w["worker_id"] for w in status["workers"]] == ["llm-0"]
    local = node.run_dir / "keys" / "local.key_secret"
    assert stat.S_IMODE(local.stat().st_mode) == 0o600
    # This host's commands (the node's user) use that local key too.
    asked = node.cli("ask", "--route", "llm", "hi", "--max-tokens", "3")
    assert asked.returncode == 0, asked.stderr


def test_a_client_without_an_allowed_key_gets_nothing_and_is_counted(
    make_node: NodeFactory, keys: Keys, tmp_path: Path
) -> None:
    node = curve_node(make_node, keys, tmp_path)
    assert refused(node, "frontend", "key_not_allowed") == 0
    # One call per connection: libzmq drops a refused connection for good (no
    # reconnect after ZAP's 400), and the sync Client's next send would block.
    with (
        client(node, keys, "mallory", wait_ms=REFUSED_WAIT_MS) as mallory,
        pytest.raises(Unavailable),
    ):
        mallory.ping()
    with (
        client(node, keys, "mallory", wait_ms=REFUSED_WAIT_MS) as mallory,
        pytest.raises(Unavailable),
    ):
        mallory.generate("hello", max_tokens=2)
    assert wait_for(lambda: refused(node, "frontend", "key_not_allowed") >= 2)
    # Nothing of hers reached the broker: no request was admitted or refused.
    counters = node.status()["counters"]
    assert counters.get("admitted", 0) == 0 and counters.get("rejected_bad_request", 0) == 0


def test_a_client_with_a_wrong_server_key_or_none_gets_nothing_and_is_counted(
    make_node: NodeFactory, keys: Keys, tmp_path: Path
) -> None:
    node = curve_node(make_node, keys, tmp_path)
    # alice is allowed, but trusts another server's key (say, a spoofed node's).
    with (
        client(node, keys, "alice", server="backend", wait_ms=REFUSED_WAIT_MS) as fooled,
        pytest.raises(Unavailable),
    ):
        fooled.ping()
    assert wait_for(lambda: refused(node, "frontend", "handshake_failed") >= 1)
    before = refused(node, "frontend", "handshake_failed")
    with Client(node.frontend, wait_ms=REFUSED_WAIT_MS) as plaintext, pytest.raises(Unavailable):
        plaintext.ping()
    assert wait_for(lambda: refused(node, "frontend", "handshake_failed") > before)
    assert refused(node, "frontend", "key_not_allowed") == 0


def test_two_connections_with_one_key_share_its_in_flight_cap(
    make_node: NodeFactory, keys: Keys, tmp_path: Path
) -> None:
    node = curve_node(
        make_node,
        keys,
        tmp_path,
        broker={"max_in_flight_per_client": 1},
        workers={"count": 2, "slots": 1},
    )
    with (
        client(node, keys, "alice", wait_ms=10_000) as first,
        client(node, keys, "alice", wait_ms=10_000) as second,
        client(node, keys, "bob", wait_ms=10_000) as bob,
    ):
        slow = first.stream_generate("!slow 100 a long one", max_tokens=20)
        assert wait_for(lambda: node.status()["in_flight"] == 1)
        # Another connection, the same key: the cap is the key's, and it is full.
        with pytest.raises(Overloaded) as capped:
            second.generate("and me", max_tokens=2)
        assert capped.value.reason == "client_cap"
        # Another key has a cap of its own, while alice's request still runs.
        assert bob.generate("bob here", max_tokens=8).text == "echo: bob here"
        assert node.status()["in_flight"] == 1
        assert "".join(slow)  # alice's stream runs to its end
        # Her request ended: her key may send again, on the other connection.
        assert second.generate("now", max_tokens=2).text == "echo: now"
    assert node.status()["counters"]["shed_client_cap"] == 1


def refused_start(node: NodeProcess) -> str:
    """``edgenode start``'s error (it must fail and leave no node behind)."""
    started = node.cli("start", "--wait-s", "30")
    assert started.returncode == 1, started.stdout + started.stderr
    assert not (node.run_dir / "edgenode.pid").exists()
    return started.stderr


@pytest.mark.parametrize(
    ("spoil", "expected"),
    [
        (lambda clients, keys: clients.chmod(0o777), "writable by group or others"),
        (lambda clients, keys: (clients / "alice.key").chmod(0o666), "chmod 644"),
        (lambda clients, keys: os.chown(clients, 65534, 65534), "owned by another user"),
        (
            lambda clients, keys: (clients / "bad.key").write_bytes(
                (keys.root / "mallory.key_secret").read_bytes()
            ),
            "holds a secret key",
        ),
    ],
    ids=["dir-0777", "key-0666", "dir-of-nobody", "secret-renamed"],
)
def test_a_client_allowlist_others_could_change_or_holding_a_secret_refuses_the_start(
    make_node: NodeFactory,
    keys: Keys,
    tmp_path: Path,
    spoil: Callable[[Path, Keys], object],
    expected: str,
) -> None:
    if os.geteuid() != 0 and "nobody" in expected:
        pytest.skip("chown to another user needs root")
    node = curve_node(make_node, keys, tmp_path, start=False)
    spoil(tmp_path / "clients", keys)
    error = refused_start(node)
    assert "security.client_keys" in error and expected in error, error


def test_an_empty_client_allowlist_starts_with_a_warning_in_the_log_and_status(
    make_node: NodeFactory, keys: Keys, tmp_path: Path
) -> None:
    node = curve_node(make_node, keys, tmp_path, start=False)
    for key in (tmp_path / "clients").iterdir():
        key.unlink()
    node.start()
    assert "no client key allowed: only this host's own processes can connect" in (
        node.log.read_text()
    )
    shown = node.cli("status")
    assert shown.returncode == 0, shown.stderr
    assert "security: frontend curve (no client key allowed: only this host)" in shown.stdout


#: Strangers in ``test_a_flood_of_strangers_is_counted_exactly_and_logged_within_a_bound``.
FLOOD = 300


def test_a_flood_of_strangers_is_counted_exactly_and_logged_within_a_bound(
    make_node: NodeFactory, keys: Keys, tmp_path: Path
) -> None:
    node = curve_node(make_node, keys, tmp_path)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    strangers = []
    try:
        for _ in range(FLOOD):  # each a new key, as a scanner or a fuzzer would
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            public, secret = zmq.curve_keypair()
            sock.curve_serverkey = keys.public("node")
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.connect(node.frontend)
            strangers.append(sock)
        assert wait_for(lambda: refused(node, "frontend", "key_not_allowed") >= FLOOD, timeout=30)
        time.sleep(0.5)  # a refused peer does not retry: the count stays exact
        assert refused(node, "frontend", "key_not_allowed") == FLOOD
    finally:
        for sock in strangers:
            sock.close(0)
        ctx.term()
    named = [line for line in node.log.read_text().splitlines() if "refused a CURVE key" in line]
    assert len(named) == FIRST_KEYS  # not one line per stranger
    # The node still serves an allowed client.
    with client(node, keys, "alice", wait_ms=5000) as alice:
        assert alice.generate("still here", max_tokens=4).text == "echo: still here"


def foreign_worker(node: NodeProcess, keys: Keys, name: str, worker_id: str) -> list[str]:
    """The command line of a real worker process proving NAME's key to the node's backend."""
    backend = node.sections["node"]["backend"]
    spec = WorkerSpec(
        worker_id=worker_id,
        backend=backend,
        engine=EngineSpec(kind="test", model_path="test", n_ctx=2048, n_batch=512, threads=1),
        heartbeat_interval_ms=100,
        curve_server_key=keys.public("backend").decode(),
        curve_key_file=str(keys.root / f"{name}.key_secret"),
    )
    return module_command("node.worker", "--spec", spec.to_json())


def test_a_foreign_worker_cannot_register_on_a_curve_tcp_backend(
    make_node: NodeFactory, keys: Keys, tmp_path: Path
) -> None:
    node = curve_node(make_node, keys, tmp_path)
    procs = [
        subprocess.Popen(foreign_worker(node, keys, "stranger", "llm-evil"), cwd=REPO),
        subprocess.Popen(foreign_worker(node, keys, "agent", "llm-agent"), cwd=REPO),
    ]
    try:
        # The allowed agent registers (the test can tell a registration apart) ...
        def ids() -> list[str]:
            return sorted(w["worker_id"] for w in node.status()["workers"])

        assert wait_for(lambda: "llm-agent" in ids(), timeout=20)
        # ... the stranger, running the same code, never does: refused and counted.
        assert wait_for(lambda: refused(node, "backend", "key_not_allowed") >= 1)
        assert ids() == ["llm-0", "llm-agent"]
        assert procs[0].poll() is None  # it still tries; it just never gets in
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


def test_a_plaintext_worker_cannot_register_on_a_curve_tcp_backend(
    make_node: NodeFactory, keys: Keys, tmp_path: Path
) -> None:
    node = curve_node(make_node, keys, tmp_path)
    spec = WorkerSpec(
        worker_id="llm-plain",
        backend=node.sections["node"]["backend"],
        engine=EngineSpec(kind="test", model_path="test", n_ctx=2048, n_batch=512, threads=1),
        heartbeat_interval_ms=100,
    )
    proc = subprocess.Popen(module_command("node.worker", "--spec", spec.to_json()), cwd=REPO)
    try:
        assert wait_for(lambda: refused(node, "backend", "handshake_failed") >= 1, timeout=20)
        assert [w["worker_id"] for w in node.status()["workers"]] == ["llm-0"]
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize(
    ("node_section", "key"),
    [
        ({"frontend": "tcp://*:{port}"}, "node.frontend"),
        ({"frontend": "tcp://0.0.0.0:{port}"}, "node.frontend"),
        ({"backend": "tcp://[::]:{port}"}, "node.backend"),
    ],
)
def test_plaintext_on_a_non_loopback_endpoint_is_refused_unless_allowed(
    make_node: NodeFactory, node_section: dict[str, str], key: str
) -> None:
    port = free_port()
    section = {k: v.format(port=port) for k, v in node_section.items()}
    node = make_node(start=False, workers=ONE_WORKER, node=section)
    started = node.cli("start", "--wait-s", "30")
    assert started.returncode == 1
    assert key in started.stderr and "security.allow_plaintext" in started.stderr, started.stderr
    assert not (node.run_dir / "edgenode.pid").exists()


def register_as(backend: str, worker_id: str, uid: int | None) -> None:
    """In a forked child: become ``uid`` (None: stay), then send READY as
    ``worker_id`` on a raw DEALER every 50 ms for ``REGISTER_S``."""
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.SNDTIMEO, 50)  # never block: an unreachable backend has no pipe
    dealer.connect(backend)
    body = {"worker_id": worker_id, "engine": "llm", "slots": 1, "pid": os.getpid(), "n_ctx": 2048}
    end = time.monotonic() + REGISTER_S
    while time.monotonic() < end:
        with contextlib.suppress(zmq.Again):
            dealer.send_multipart(p.worker_frames(p.WorkerCommand.READY, body))
        time.sleep(0.05)
    dealer.close()
    ctx.term()


#: How long ``register_as`` keeps trying (s): a registered fake worker sends no
#: heartbeats, so the broker drops it 0.3 s after it stops.
REGISTER_S = 4.0


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_a_process_of_another_user_cannot_register_on_the_ipc_backend(
    make_node: NodeFactory,
) -> None:
    # The default ipc backend stays plaintext: its 0700 directory is the fence.
    node = make_node(workers=ONE_WORKER)
    backend = f"ipc://{node.run_dir}/workers/backend.sock"
    fork = multiprocessing.get_context("fork")

    def ids() -> list[str]:
        return sorted(w["worker_id"] for w in node.status()["workers"])

    nobody = fork.Process(target=register_as, args=(backend, "llm-nobody", 65534))
    nobody.start()
    try:
        time.sleep(REGISTER_S / 2)
        assert nobody.is_alive()  # still trying while the node is asked
        assert ids() == ["llm-0"]
    finally:
        nobody.join(10)
    assert nobody.exitcode == 0
    # The same registration from the node's own user gets in: the test can tell.
    own = fork.Process(target=register_as, args=(backend, "llm-own", None))
    own.start()
    try:
        assert wait_for(lambda: "llm-own" in ids(), timeout=REGISTER_S / 2)
    finally:
        own.join(10)
