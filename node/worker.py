"""Worker process entry point: ``python -m node.worker --spec JSON``.

The I/O thread owns the DEALER to the broker (zmq sockets are not
thread-safe): READY, heartbeats (which carry the progress counter), REQUEST and
CANCEL, and it relays the engine's output, which reaches it over an inproc PULL.
Requests run on engine threads, up to ``slots`` at once (credit = free slots):

* a batching engine (``node.engine.BatchEngine``: the llama engine) is stepped
  by one thread, all its slots decoded together in one llama context;
* any other engine (test, rules) runs one request per thread, ``slots`` threads.

llama.cpp releases the GIL inside its C calls, so heartbeats keep flowing while
the model computes. The model is loaded before the worker connects: a slow load
can never look like a dead worker, and READY means "can serve now".

A worker re-registers (new socket, new identity, READY once idle) only when the
broker lost its identity: the broker said DISCONNECT, or the connection dropped
(a restarted broker; a dead TCP peer, found by ZMTP heartbeats). A broker that is
only silent (paused) keeps the worker's identity and gets its answers late.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq
import zmq.auth

from broker import protocol as p
from broker.errors import EdgeNodeError, ErrorCode, InternalError
from broker.kinds import HeartbeatState
from broker.protocol import WorkerCommand
from node.config import MAX_DURATION_MS as MAX_POLL_MS
from node.engine import (
    LOADS,
    BatchEngine,
    Engine,
    EngineName,
    EngineSpec,
    Outcome,
    TestEngine,
    load_error_line,
)
from node.observe.logs import LOG_FORMATS, WORKER_TEXT_FORMAT, about_request
from node.observe.logs import configure as configure_logs
from node.remote.registration import RegistrationNote
from node.sandbox.cgroups import join_cgroup
from node.sandbox.cores import apply_placement
from node.sandbox.oom import raise_oom_score_adj

log = logging.getLogger("edgenode.worker")

#: Exit codes (sysexits.h): the supervisor does not restart these in a loop,
#: because a new process would fail the same way.
EXIT_CONFIG = 78  # EX_CONFIG
EXIT_MODEL_LOAD = 66  # EX_NOINPUT: the engine's model (or rules) file cannot be loaded
EXIT_ENGINE_BUG = 70  # EX_SOFTWARE: a batch step failed; restarted like a crash
DETERMINISTIC_EXITS = (EXIT_CONFIG, EXIT_MODEL_LOAD)
#: How much of a worker's exit message (``--exit-message-file``) its status shows (bytes).
EXIT_MESSAGE_MAX_BYTES = 512
#: A connection to the broker whose ZMTP PINGs (one per heartbeat interval) go
#: unanswered for this many heartbeat livenesses is given up (``ZMQ_HEARTBEAT_TIMEOUT``:
#: 30 s by default): the last resort against a TCP link gone without a FIN. Far
#: beyond the broker's own liveness, so a broker that is only paused (SIGSTOP, a
#: VM or swap stall) keeps its workers' identities and their answers.
LINK_TIMEOUT_LIVENESSES = 10


def exit_meaning(code: int, kind: EngineName) -> str | None:
    """What a deterministic exit ``code`` of a worker running ``kind`` means, or None."""
    if code == EXIT_CONFIG:
        return "bad worker configuration"
    if code == EXIT_MODEL_LOAD:
        return f"{LOADS[kind]} failed to load"
    return None


def write_exit_message(path: str | None, line: str) -> None:
    """Leave one line saying why this worker exits where its supervisor reads it
    (the pattern of Kubernetes' terminationMessagePath); best effort."""
    if path is None:
        return
    try:
        with open(path, "w", encoding="utf-8") as fh:
            one = line.replace("\n", " ").encode()[:EXIT_MESSAGE_MAX_BYTES]
            fh.write(one.decode(errors="ignore") + "\n")
    except OSError as exc:
        log.warning("cannot write the exit message to %s: %s", path, exc)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs, handed over as JSON on its command line."""

    worker_id: str
    backend: str
    engine: EngineSpec
    slots: int = 1
    heartbeat_interval_ms: int = 500
    heartbeat_liveness: int = 3
    info: dict[str, Any] = field(default_factory=dict)
    #: ``cgroup.procs`` files to join before loading (from ``Sandbox.create_worker``).
    cgroup_procs: tuple[str, ...] = ()
    #: Cores to pin to (empty = leave affinity alone) and the nice level.
    cpus: tuple[int, ...] = ()
    nice: int = 0
    #: µs; the scheduler slice to ask for (``workers.slice_us``; 0 = the kernel's).
    slice_us: int = 0
    #: ``/proc/self/oom_score_adj`` to set (``workers.oom_score_adj``; 0 = leave it).
    oom_score_adj: int = 0
    #: ``broker.max_body_bytes``: the socket cap and the reply limits come from it
    #: (``broker.protocol.message_limits``), the same as the broker's.
    max_body_bytes: int = p.DEFAULT_MAX_BODY_BYTES
    #: A backend with CURVE: its server public key (Z85) and the file holding this
    #: worker's keypair (``zmq.auth`` format, mode 0600; a path, so the secret is
    #: never on a command line). Both "" on a plaintext backend.
    curve_server_key: str = ""
    curve_key_file: str = ""

    def to_json(self) -> str:
        """Serialize for ``--spec``."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WorkerSpec:
        """Parse ``--spec``; raises ``ValueError``/``TypeError``/``KeyError`` if malformed."""
        data = json.loads(text)
        data["engine"] = EngineSpec(**data["engine"])
        data["cgroup_procs"] = tuple(data.get("cgroup_procs", ()))
        data["cpus"] = tuple(data.get("cpus", ()))
        return cls(**data)


class WorkerLoop:
    """The I/O side of a worker: registration, heartbeats, requests, cancellation."""

    def __init__(self, spec: WorkerSpec, engine: Engine) -> None:
        self.spec = spec
        self.engine = engine
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.interval = spec.heartbeat_interval_ms / 1000
        self.limits = p.message_limits(spec.max_body_bytes)
        # Bytes of text sent in PARTIALs per rid, and the rids stopped for passing
        # limits.text_bytes; only the I/O thread touches them.
        self._streamed: dict[int, int] = {}
        self._outgrew: set[int] = set()
        self.progress = 0  # tokens produced by this process; written by the engine threads
        self.started = 0  # requests taken into a slot (HEARTBEAT "started"; safe retry's proof)
        self.running: dict[int, threading.Event] = {}  # rid -> its cancel flag
        #: rid -> the client's id (REQUEST ``request_id``), for log lines only; written
        #: by the I/O thread before the job is queued, read by the engine threads.
        self.request_ids: dict[int, str | int | None] = {}
        self._abandoned: set[int] = set()  # rids started under a previous connection
        self._jobs: queue.Queue[tuple[int, dict[str, Any], threading.Event] | None] = queue.Queue()
        self._pipe_addr = f"inproc://engine-{uuid.uuid4().hex}"
        self._events = self.ctx.socket(zmq.PULL)
        self._events.bind(self._pipe_addr)
        self._stop = False
        self._want_ready = True
        self.dealer: zmq.Socket[bytes] | None = None
        #: The dealer's socket monitor (handshakes and disconnects), and whether a
        #: handshake with the broker succeeded on this dealer.
        self._monitor: zmq.Socket[bytes] | None = None
        self._linked = False
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._poller = zmq.Poller()
        #: Pieces of text ``(rid, text)`` read from the engine threads and not yet
        #: sent: one PARTIAL carries all that one turn read (PROTOCOL §13.2).
        self._parts: list[tuple[int, str]] = []
        #: For a host agent's worker: notes that the broker registered it.
        self._registration = RegistrationNote.from_env(spec.worker_id)

    # ------------------------------------------------------------------ main loop

    def run(self) -> int:
        """Serve until SIGTERM/SIGINT; returns the process exit code."""
        signal.set_wakeup_fd(self._wake_w.fileno())
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        if isinstance(self.engine, BatchEngine):
            targets = [self._batch_thread]
        else:
            targets = [self._engine_thread] * self.spec.slots
        self._threads = [
            threading.Thread(target=target, name=f"engine-{i}", daemon=True)
            for i, target in enumerate(targets)
        ]
        for thread in self._threads:
            thread.start()
        self._connect()
        next_beat = time.monotonic()
        while not self._stop:
            now = time.monotonic()
            if now >= next_beat:
                self._heartbeat()
                next_beat = now + self.interval
            self._turn(max(0.0, next_beat - time.monotonic()))
        self._shutdown()
        return 0

    def _turn(self, timeout_s: float) -> None:
        assert self.dealer is not None
        # zmq_poll takes a C int of ms: the +1 must not overflow at the longest interval.
        ready = dict(self._poller.poll(min(int(timeout_s * 1000) + 1, MAX_POLL_MS)))
        if self._events in ready:
            # All that the engine threads sent so far, then one PARTIAL for its text.
            for frames in _drain(self._events):
                self._on_engine_event(frames)
            self._send_parts()
        if self.dealer in ready:
            dealer = self.dealer
            # Until a DISCONNECT replaces the socket: the rest was the old broker's.
            while dealer is self.dealer:
                try:
                    frames = dealer.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._on_broker(frames)
        # After the dealer's messages: those the broker sent before the link dropped.
        if self._monitor is not None and self._monitor in ready:
            self._on_link_events()
        if self._wake_r.fileno() in ready:
            with contextlib.suppress(BlockingIOError):
                self._wake_r.recv(64)

    def _on_link_events(self) -> None:
        """Re-register when the connection the worker registered on is gone.

        Only a dropped connection means the broker lost this identity: it closed
        (a broker restarted, or killed: libzmq reconnects this socket to whatever
        serves the endpoint next) or its PINGs went unanswered for
        ``LINK_TIMEOUT_LIVENESSES`` heartbeat livenesses (a dead TCP peer). Mere silence on a live
        connection is a paused broker, which takes this identity's FINALs when it
        resumes: re-registering then made it re-run them (test_faults.py::
        test_requests_that_end_during_a_pause_of_the_node_run_once). A broker that
        dropped this worker while connected says DISCONNECT (``_on_broker``)."""
        assert self._monitor is not None
        monitor = self._monitor
        while monitor is self._monitor:
            try:
                event = monitor_event(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._linked = True
            elif event == zmq.EVENT_DISCONNECTED and self._linked:
                # Before any handshake (a refused CURVE key, a broker not up yet)
                # libzmq's own retries are enough: nothing was registered.
                log.warning("connection to the broker lost: re-registering")
                self._reconnect()

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self._stop = True

    # ------------------------------------------------------------------ broker side

    def _connect(self) -> None:
        self.dealer = self.ctx.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.IDENTITY, uuid.uuid4().bytes)  # fresh per incarnation
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.SNDHWM, 1000)
        self.dealer.setsockopt(zmq.MAXMSGSIZE, self.limits.frame_bytes)
        self.dealer.setsockopt(zmq.IPV6, 1)  # a backend on an IPv6 address (PROTOCOL §2)
        # ZMTP PINGs, answered by the broker's libzmq I/O thread: a dead TCP peer
        # drops the connection (then ``_on_link_events`` re-registers).
        interval_ms = self.spec.heartbeat_interval_ms
        link_timeout_ms = min(
            interval_ms * self.spec.heartbeat_liveness * LINK_TIMEOUT_LIVENESSES, MAX_POLL_MS
        )  # a C int of ms, as the config's interval x liveness
        self.dealer.setsockopt(zmq.HEARTBEAT_IVL, interval_ms)
        self.dealer.setsockopt(zmq.HEARTBEAT_TIMEOUT, link_timeout_ms)
        if self.spec.curve_server_key:
            public, secret = zmq.auth.load_certificate(self.spec.curve_key_file)
            assert secret is not None  # node.security.keys.local_keypair wrote both
            self.dealer.setsockopt(zmq.CURVE_SERVERKEY, self.spec.curve_server_key.encode())
            self.dealer.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.dealer.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self._monitor = self.dealer.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
        )
        self._linked = False
        self.dealer.connect(self.spec.backend)
        self._poller = zmq.Poller()
        self._poller.register(self.dealer, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._poller.register(self._events, zmq.POLLIN)
        self._poller.register(self._wake_r.fileno(), zmq.POLLIN)
        self._want_ready = True
        self._registration.connected()
        self._send_ready_if_idle()

    def _reconnect(self) -> None:
        """New socket, new identity. READY waits until every running job has ended,
        so the new broker never sees credit this worker cannot honour."""
        self._parts.clear()  # the old connection's requests: the new broker never knew them
        for rid, cancelled in self.running.items():
            cancelled.set()  # nobody awaits its result any more
            self._abandoned.add(rid)  # and the new broker never knew it
        self._close_dealer()
        self._connect()

    def _close_dealer(self) -> None:
        """Close the dealer and its monitor (LINGER 0: its unsent messages are dropped)."""
        assert self.dealer is not None and self._monitor is not None
        self.dealer.disable_monitor()
        self._monitor.close(0)
        self._monitor = None
        self.dealer.close(0)

    def _send_ready_if_idle(self) -> None:
        if not self._want_ready or self.running:
            return
        self._want_ready = False
        body = {
            "worker_id": self.spec.worker_id,
            "engine": self.engine.kind if self.engine.kind != "llama" else "llm",
            "model": self.engine.model,
            "slots": self.spec.slots,
            "n_ctx": self.engine.n_ctx,
            "pid": os.getpid(),
            "cpus": sorted(os.sched_getaffinity(0)),
            "threads": self.spec.engine.threads,
            "cgroup": _cgroup_dir(self.spec.cgroup_procs),
            "nice": os.getpriority(os.PRIO_PROCESS, 0),
            "protocol": p.PROTOCOL_VERSION,
            **self.spec.info,
        }
        self._send(WorkerCommand.READY, body)

    def _send(self, command: WorkerCommand, body: dict[str, Any]) -> None:
        assert self.dealer is not None
        try:
            self.dealer.send_multipart(p.worker_frames(command, body), zmq.NOBLOCK)
        except zmq.Again:
            log.warning("broker not reading: dropped %s", command.name)

    def _heartbeat(self) -> None:
        state: HeartbeatState = "busy" if self.running else "idle"
        body: dict[str, Any] = {
            "state": state,
            "progress": self._progress(),
            "started": self.started,
        }
        if isinstance(self.engine, BatchEngine):
            body["compute_threads"] = self.engine.compute_threads
        self._send(WorkerCommand.HEARTBEAT, body)

    def _progress(self) -> int:
        """Tokens emitted plus engine compute steps: it moves iff the model works."""
        return self.progress + self.engine.steps

    def _on_broker(self, frames: list[bytes]) -> None:
        try:
            command, body = p.parse_worker_frames(frames)
        except EdgeNodeError as exc:
            log.warning("ignoring a malformed broker message: %s", exc)
            return
        if command is not WorkerCommand.DISCONNECT:
            self._registration.heard()  # sent to registered workers only
        if command is WorkerCommand.REQUEST:
            self._on_request(body)
        elif command is WorkerCommand.CANCEL:
            rid = body.get("rid")
            if isinstance(rid, int) and rid in self.running:
                log.debug(
                    "request %r cancelled by the broker",
                    self.request_ids.get(rid),
                    extra=self._about(rid, step="cancel"),
                )
                self.running[rid].set()
        elif command is WorkerCommand.DISCONNECT:
            log.info("broker said DISCONNECT (%s): re-registering", body.get("reason"))
            self._reconnect()

    def _on_request(self, body: dict[str, Any]) -> None:
        rid = body.get("rid")
        if not isinstance(rid, int):
            return
        if len(self.running) >= self.spec.slots or rid in self.running:
            # The broker's credit says a slot is free: refuse rather than queue.
            busy = {
                "rid": rid,
                "status": "error",
                "code": int(ErrorCode.UNAVAILABLE),
                "message": "worker has no free slot",
            }
            self._send(WorkerCommand.FINAL, busy)
            return
        cancelled = threading.Event()
        self.running[rid] = cancelled
        self.started += 1
        request_id = body.pop("request_id", None)
        self.request_ids[rid] = request_id
        log.debug(
            "request %r started (rid %d)", request_id, rid, extra=self._about(rid, step="started")
        )
        self._jobs.put((rid, body, cancelled))

    # ------------------------------------------------------------------ engine side

    def _on_engine_event(self, frames: list[bytes]) -> None:
        """One message of an engine thread: ``partials`` (``{parts: [[rid, text],
        ...]}``, in order) or ``final`` (a FINAL body). Pieces of text wait in
        ``_parts`` for ``_send_parts``; a FINAL sends them first, so the broker
        never sees a request's text after its FINAL. When every piece waiting is
        the FINAL's own request's, they ride on it (``parts``, PROTOCOL §13.2):
        one message where a PARTIAL and a FINAL were two."""
        kind, payload = frames[0], p.unpack_map(frames[1])
        if kind == b"partials":
            for rid, text in payload["parts"]:
                if rid not in self._abandoned:
                    self._relay_partial(rid, text)
            return
        rid = payload["rid"]
        abandoned = rid in self._abandoned
        parts = self._parts
        own = bool(parts) and not abandoned and all(part[0] == rid for part in parts)
        if not own:
            self._send_parts()
        self._streamed.pop(rid, None)
        self._log_final(rid, payload, rid in self._abandoned)
        outgrew = rid in self._outgrew
        self._outgrew.discard(rid)
        if abandoned:
            self._abandoned.discard(rid)
        else:
            # A FINAL over the broker's socket cap would cost the connection and
            # every request on it: a reply too long is this request's 413.
            final = p.fit_final(payload, self.limits, outgrew)
            if own:
                # Its text's last pieces, at most text_bytes: the FINAL still fits the cap.
                final["parts"] = [list(part) for part in parts]
                final["progress"] = self._progress()
                parts.clear()
            self._send(WorkerCommand.FINAL, final)
        self.running.pop(rid, None)
        self.request_ids.pop(rid, None)
        self._send_ready_if_idle()

    def _about(self, rid: int, **fields: Any) -> dict[str, Any]:
        """``extra=`` of a line about request ``rid`` (``node.observe.logs``)."""
        return about_request(self.request_ids.get(rid), rid=rid, **fields)

    def _log_final(self, rid: int, payload: dict[str, Any], abandoned: bool) -> None:
        """One line for request ``rid``'s end: ``debug`` when it succeeded, ``info``
        with its message when it failed or was cancelled (clipped: ``final_body``)."""
        status = payload.get("status")
        request_id = self.request_ids.get(rid)
        extra = self._about(rid, step="final", status=status, code=payload.get("code"))
        said = f"request {request_id!r} (rid {rid}) ended {status}"
        if abandoned:
            log.debug("%s, abandoned", said, extra=extra)
        elif status == "ok":
            log.debug("%s", said, extra=extra)
        else:
            log.info("%s: %s", said, payload.get("message"), extra=extra)

    def _relay_partial(self, rid: int, text: str) -> None:
        """Queue a piece of text for the broker while the request's text fits a reply;
        at the first piece past ``limits.text_bytes``, stop the request (its FINAL
        becomes a 413)."""
        if rid in self._outgrew:
            return
        sent = self._streamed.get(rid, 0) + len(text.encode())
        if sent > self.limits.text_bytes:
            self._outgrew.add(rid)
            if rid in self.running:
                self.running[rid].set()
            return
        self._streamed[rid] = sent
        self._parts.append((rid, text))

    def _send_parts(self) -> None:
        """Send the queued pieces of text: one PARTIAL ``{rid, text, progress}``, or
        for several (one decode step of many slots, or tokens that came while the
        I/O thread was busy) one ``{parts: [[rid, text], ...], progress}``: a message
        per piece cost the broker and this thread a wake-up each (PROTOCOL §13.2)."""
        parts = self._parts
        if not parts:
            return
        if len(parts) == 1:
            rid, text = parts[0]
            body: dict[str, Any] = {"rid": rid, "text": text, "progress": self._progress()}
        else:
            body = {"parts": [list(part) for part in parts], "progress": self._progress()}
        parts.clear()
        self._send(WorkerCommand.PARTIAL, body)

    def _engine_thread(self) -> None:
        """One request at a time through ``engine.run`` (engines that do not batch)."""
        out = self._pusher()
        while True:
            item = self._jobs.get()
            if item is None:
                break
            rid, job, cancelled = item
            out.send_multipart([b"final", p.pack(self._run_one(out, rid, job, cancelled))])
        out.close(0)

    def _run_one(
        self, out: zmq.Socket[bytes], rid: int, job: dict[str, Any], cancelled: threading.Event
    ) -> dict[str, Any]:
        """Run ``job`` through ``engine.run``; its FINAL body, whatever happened."""
        try:
            outcome: Outcome = self.engine.run(job, cancelled, self._emitter(out, rid))
        except EdgeNodeError as exc:
            outcome = exc
        except Exception as exc:  # an engine bug must cost one request, not the worker
            outcome = _engine_bug(rid, exc, self.request_ids.get(rid))
        return final_body(rid, outcome)

    def _batch_thread(self) -> None:
        """Every slot of a batching engine, stepped together: new requests join
        between steps; the thread blocks only while no slot is busy. The text of
        one step, every slot's, goes to the I/O thread as one message, before the
        FINALs of the requests that ended in it."""
        engine = self.engine
        assert isinstance(engine, BatchEngine)
        out = self._pusher()
        step_parts: list[tuple[int, str]] = []

        def send_parts() -> None:
            if step_parts:
                out.send_multipart([b"partials", p.pack({"parts": step_parts})])
                step_parts.clear()

        def send_final(rid: int, outcome: Outcome) -> None:
            send_parts()  # a request's text before its FINAL
            out.send_multipart([b"final", p.pack(final_body(rid, outcome))])

        while True:
            items = [self._jobs.get()] if not engine.busy else []
            with contextlib.suppress(queue.Empty):
                while True:
                    items.append(self._jobs.get_nowait())
            for item in items:
                if item is None:
                    out.close(0)
                    return
                rid, job, cancelled = item
                try:
                    engine.submit(rid, job, cancelled, self._collector(step_parts, rid))
                except EdgeNodeError as exc:
                    send_final(rid, exc)
                except Exception as exc:  # an engine bug must cost one request, not the worker
                    send_final(rid, _engine_bug(rid, exc, self.request_ids.get(rid)))
            if not engine.busy:
                send_parts()
                continue
            try:
                ended = engine.step()
            except Exception:
                # The slots' state is unknown now: a fresh process is the way back,
                # and the broker re-dispatches what had streamed nothing.
                log.critical("engine step failed: exiting", exc_info=True)
                os._exit(EXIT_ENGINE_BUG)
            send_parts()
            for rid, outcome in ended:
                send_final(rid, outcome)

    def _pusher(self) -> zmq.Socket[bytes]:
        """An engine thread's own socket to the I/O thread."""
        out = self.ctx.socket(zmq.PUSH)
        out.connect(self._pipe_addr)
        return out

    def _emitter(self, out: zmq.Socket[bytes], rid: int) -> Callable[[str], None]:
        """The ``emit`` of request ``rid`` on its own engine thread: each piece of
        text to the I/O thread at once."""

        def emit(text: str) -> None:
            self.progress += 1
            out.send_multipart([b"partials", p.pack({"parts": [(rid, text)]})])

        return emit

    def _collector(self, step_parts: list[tuple[int, str]], rid: int) -> Callable[[str], None]:
        """The ``emit`` of request ``rid`` in a batching engine: its pieces of text
        join the step's (``_batch_thread`` sends them after the step)."""

        def emit(text: str) -> None:
            self.progress += 1
            step_parts.append((rid, text))

        return emit

    def _shutdown(self) -> None:
        for cancelled in self.running.values():
            cancelled.set()
        for _ in self._threads:
            self._jobs.put(None)
        self._send(WorkerCommand.DISCONNECT, {"reason": "worker stopping"})
        self._close_dealer()
        self._events.close(0)
        # Engine threads are daemons: a generation stuck in C cannot hold up
        # exit, so the context is only terminated once those threads are gone.
        end = time.monotonic() + 2.0
        for thread in self._threads:
            thread.join(timeout=max(0.0, end - time.monotonic()))
        if not any(thread.is_alive() for thread in self._threads):
            self.ctx.term()


def _drain(sock: zmq.Socket[bytes]) -> list[list[bytes]]:
    """Every message ``sock`` holds now (non-blocking), oldest first: reading them
    all before acting lets one PARTIAL carry every piece of text among them."""
    messages = []
    while True:
        try:
            messages.append(sock.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return messages


def final_body(rid: int, outcome: Outcome) -> dict[str, Any]:
    """The FINAL body of request ``rid`` from how it ended (PROTOCOL: worker FINAL)."""
    if isinstance(outcome, dict):
        return {"rid": rid, "status": "ok", **outcome}
    status = "cancelled" if outcome.code == ErrorCode.CANCELLED else "error"
    message = clip(outcome.message)
    return {
        "rid": rid,
        "status": status,
        "code": int(outcome.code),
        "message": message,
        "text": outcome.partial_text,
    }


def _engine_bug(rid: int, exc: Exception, request_id: str | int | None = None) -> InternalError:
    """An unexpected engine exception as this request's 500; ``request_id``: the
    client's id, for the log line."""
    message = clip(f"engine error: {type(exc).__name__}: {exc}")
    extra = about_request(request_id, rid=rid)
    log.error("engine failed on request %r (rid %d): %s", request_id, rid, message, extra=extra)
    exc_info = (type(exc), exc, exc.__traceback__)
    log.debug("engine failure on request %r", request_id, exc_info=exc_info, extra=extra)
    return InternalError(message)


def _cgroup_dir(procs_files: tuple[str, ...]) -> str | None:
    """The worker's cgroup directory (the first hierarchy's), for READY and status."""
    return os.path.dirname(procs_files[0]) if procs_files else None


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when the node that spawned it dies.

    Workers live in their own process groups (so the supervisor can kill a
    whole worker tree); without this, a node killed with ``kill -9`` would
    leave them running. PR_SET_PDEATHSIG = 1 (prctl(2)). No-op elsewhere.
    """
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


#: Longest error message a worker sends or logs (characters). Messages may quote
#: client input (a rejected json_schema, whole), which would flood the worker's log
#: (test_worker_messages.py::
#: test_an_error_quoting_client_input_is_clipped_in_the_reply_and_the_log).
MAX_MESSAGE_CHARS = 512


def clip(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to ``limit`` characters, saying how much was cut."""
    if len(message) <= limit:
        return message
    return f"{message[:limit]}... [{len(message) - limit} more characters]"


def monitor_event(frames: list[bytes]) -> int:
    """The event number of a socket monitor's message (zmq_socket_monitor(3), libzmq 4:
    a 6-byte frame of a 16-bit event and a 32-bit value, then the endpoint).

    pyzmq's ``zmq.utils.monitor`` decodes the same, but importing it imports
    ``zmq.asyncio`` and asyncio: ~80-95 ms of CPU of every worker's start
    (docs/bench/figures.md, "Start to ready").

    Raises:
        ValueError: not a monitor message.
    """
    if len(frames) != 2 or len(frames[0]) != 6:
        raise ValueError(f"not a socket monitor message: {frames!r}")
    event, _value = struct.unpack("=hi", frames[0])
    return int(event)


def make_engine(spec: EngineSpec) -> Engine:
    """Build the engine named by ``spec.kind``: ``llama``, ``test`` or ``rules``
    (the rule engine, with ``model_path`` naming its rules file)."""
    if spec.kind == "test":
        return TestEngine(spec)
    if spec.kind == "rules":
        from fallback.engine import RuleEngine

        return RuleEngine.from_file(spec.model_path)
    from node.llama.engine import LlamaEngine  # llama_cpp loads only where needed

    return LlamaEngine(spec)


def main(argv: list[str] | None = None) -> int:
    """Parse ``--spec``, load the engine, serve; returns the exit code."""
    parser = argparse.ArgumentParser(prog="python -m node.worker")
    parser.add_argument("--spec", required=True, help="WorkerSpec as JSON")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-format", default="text", choices=LOG_FORMATS)
    parser.add_argument(
        "--keep-without-parent",
        action="store_true",
        help="do not die with the spawning process (standalone workers)",
    )
    parser.add_argument(
        "--exit-message-file",
        help="on a deterministic exit, write one line saying why to this file",
    )
    args = parser.parse_args(argv)
    if not args.keep_without_parent:
        die_with_parent()
    try:
        spec = WorkerSpec.from_json(args.spec)
    except (ValueError, TypeError, KeyError) as exc:
        configure_logs(args.log_level, args.log_format, "worker", WORKER_TEXT_FORMAT)
        log.error("bad worker spec: %s", exc)
        write_exit_message(args.exit_message_file, f"bad worker spec: {exc}")
        return EXIT_CONFIG
    configure_logs(args.log_level, args.log_format, spec.worker_id, WORKER_TEXT_FORMAT)
    try:
        # Before the model loads: its page cache is charged to whoever touches
        # it first, and llama.cpp's threads inherit the affinity and nice level.
        join_cgroup(spec.cgroup_procs)
        if spec.cpus or spec.nice or spec.slice_us:
            apply_placement(spec.cpus or tuple(os.sched_getaffinity(0)), spec.nice, spec.slice_us)
        if spec.oom_score_adj:
            raise_oom_score_adj(spec.oom_score_adj)
    except EdgeNodeError as exc:
        log.error("cannot enter the sandbox: %s", exc.message)
        write_exit_message(args.exit_message_file, f"cannot enter the sandbox: {exc.message}")
        return EXIT_CONFIG
    try:
        engine = make_engine(spec.engine)
    except Exception as exc:
        log.error("cannot load engine %s (%s): %s", spec.engine.kind, spec.engine.model_path, exc)
        write_exit_message(args.exit_message_file, load_error_line(exc))
        return EXIT_MODEL_LOAD
    log.info("%s ready: engine=%s model=%s", spec.worker_id, engine.kind, engine.model)
    return WorkerLoop(spec, engine).run()


if __name__ == "__main__":
    sys.exit(main())
