"""The servers the throughput and startup scenarios measure, behind one ``Backend``
interface: the node (``NodeBackend``), llama-cpp-python alone in a subprocess
(``DirectBackend``, whose subprocess is this module run as ``python -m
node.bench.backends``: ``serve_direct``) and llama.cpp's ``llama-server``
(``ServerBackend``); and how their processes are pinned and started.

Each backend owns the processes it starts and its clients' protocol; the benchmark's
docstring of ``node.bench.throughput`` says how each is run and why.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import psutil

from node.config import WorkersSection
from node.interpreter import module_command
from node.sandbox.cores import allowed_cores, reserved_cores
from node.testing import DIE_WITH_HARNESS, NodeProcess, free_port

#: The context of every sequence, in every backend (the default ``model.n_ctx``).
N_CTX = 2048
#: The node's request budget (ms): large, so admission never refuses a queued request.
TIMEOUT_MS = 600_000
#: s; how long a started node may take to load the broker's token counter (~2.4 s of
#: CPU here) before the node backend gives up.
COUNTER_WAIT_S = 60.0


@dataclass(frozen=True)
class Outcome:
    """One request: seconds from sending it to its first text and to its end, the
    tokens generated, and the prompt tokens whose KV the server reused from an earlier
    request (None: not reported)."""

    ttft_s: float
    total_s: float
    tokens: int
    cached: int | None = None


#: Sends one prompt and waits for its end (one client's session; not thread-safe).
Ask = Callable[[str, int], Outcome]


class Backend(ABC):
    """Something that serves completions; ``start`` and ``stop`` run on the main thread."""

    name: str

    @abstractmethod
    def start(self, level: int) -> list[int]:
        """Start serving ``level`` concurrent requests; returns the pids to check pinning of."""

    @abstractmethod
    def stop(self) -> None:
        """Stop and wait for every process this backend started."""

    @abstractmethod
    def session(self) -> contextlib.AbstractContextManager[Ask]:
        """One client's connection (used by one thread)."""

    def details(self) -> dict[str, Any]:
        """What the backend ran with, once started (threads per worker, flags, ...)."""
        return {}

    def sequences(self) -> int:
        """How many requests it runs at once, at most (0: as many as it is sent)."""
        return 0


# ---------------------------------------------------------------------- pinning


def default_cores() -> list[int]:
    """The cores the node's default config gives its workers on this host
    (``workers.cpus = "auto"``: all allowed but the first; the one core of a
    one-core host): where a comparison of the default layout runs every backend."""
    allowed = allowed_cores()
    return list(reserved_cores(WorkersSection().cpus, allowed) or allowed)


def cpu_list(cpus: Iterable[int]) -> str:
    """``0,1`` for taskset -c."""
    return ",".join(str(c) for c in sorted(cpus))


@contextlib.contextmanager
def pinned(cpus: Sequence[int]) -> Iterator[None]:
    """Pin the calling thread to ``cpus`` (processes it starts inherit it), then restore."""
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


def affinities(pids: Sequence[int]) -> dict[str, list[int]]:
    """The affinity of every thread of ``pids`` and their descendants, grouped:
    ``{"0,1": [pid, ...]}`` (a process appears once per distinct thread affinity)."""
    seen: dict[str, list[int]] = {}
    procs: list[psutil.Process] = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            procs += [proc, *proc.children(recursive=True)]
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            masks = {cpu_list(os.sched_getaffinity(t.id)) for t in proc.threads()}
            for mask in masks:
                seen.setdefault(mask, []).append(proc.pid)
    return seen


def spawn(
    argv: list[str], cpus: Sequence[int], nice: int, log: Path, **kw: Any
) -> subprocess.Popen[bytes]:
    """Start ``argv`` under ``taskset -c cpus`` and ``nice``, in a session of its own,
    as a child that gets SIGTERM when this process dies (node/testing.py's wrapper).
    Call from the main thread only (PR_SET_PDEATHSIG follows the starting thread)."""
    taskset, nice_bin = shutil.which("taskset"), shutil.which("nice")
    if taskset is None or nice_bin is None:
        raise SystemExit("taskset and nice (util-linux, coreutils) are needed")
    cmd = [sys.executable, "-c", DIE_WITH_HARNESS, str(os.getpid())]
    cmd += [taskset, "-c", cpu_list(cpus), nice_bin, "-n", str(nice), *argv]
    with open(log, "ab") as err:
        return subprocess.Popen(cmd, stderr=err, start_new_session=True, **kw)


def end(proc: subprocess.Popen[Any], timeout: float = 30) -> None:
    """SIGTERM ``proc`` (if still running) and wait; SIGKILL its group if it lingers."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---------------------------------------------------------------------- the node


class NodeBackend(Backend):
    """edgenode with ``workers`` x ``slots``, model only."""

    def __init__(
        self,
        workers: int,
        slots: int,
        threads: int,
        cpus: Sequence[int],
        nice: int,
        repack: bool,
        flash_attn: str,
    ) -> None:
        self.name = f"node {workers}x{slots}" + (" repack" if repack else "")
        self.cpus = cpus
        self.sections: dict[str, dict[str, Any]] = {
            # cpus = []: every core it is pinned to, as the other backends get them.
            "workers": {
                "engine": "llama",
                "count": workers,
                "threads": threads,
                "nice": nice,
                "cpus": [],
            },
            "routing": {"mode": "full"},
            "fallback": {"rules": ""},
            "broker": {"max_in_flight_per_client": 64, "max_timeout_ms": TIMEOUT_MS},
        }
        self.capacity = workers * slots
        self.sections["workers"]["slots"] = slots  # explicit: the default may change
        model: dict[str, Any] = {"repack": True} if repack else {}
        if flash_attn != "default":
            model["flash_attn"] = flash_attn == "on"
        if model:
            self.sections["model"] = model
        self.node: NodeProcess | None = None
        self.workers: list[dict[str, Any]] = []

    def start(self, level: int) -> list[int]:
        self.node = NodeProcess(self.sections)
        with pinned(self.cpus):
            self.node.start(timeout=180)
        # Measured once the node's work after ready is done, as llama-server is after
        # its load: the broker's token counter (~2.4 s of CPU) starved the worker's
        # first seconds (an adaptive worker drops to one thread for them).
        loaded_by = time.monotonic() + COUNTER_WAIT_S
        while self.node.status().get("token_counter") in ("waiting", "loading"):
            if time.monotonic() > loaded_by:
                raise RuntimeError(f"the node's token counter did not load in {COUNTER_WAIT_S} s")
            time.sleep(0.2)
        processes = self.node.status()["processes"]
        self.workers = [
            {k: p.get(k) for k in ("worker_id", "pid", "threads", "slots", "cpus", "nice")}
            for p in processes
        ]
        assert self.node.proc is not None
        return [self.node.proc.pid]

    def stop(self) -> None:
        if self.node is not None:
            self.node.cleanup()
            self.node = None

    def details(self) -> dict[str, Any]:
        return {"config": self.sections, "workers": self.workers}

    def sequences(self) -> int:
        return self.capacity

    @contextlib.contextmanager
    def session(self) -> Iterator[Ask]:
        assert self.node is not None
        with self.node.client() as client:

            def ask(prompt: str, max_tokens: int) -> Outcome:
                start = time.monotonic()
                first: float | None = None
                stream = client.stream_generate(
                    prompt, max_tokens=max_tokens, temperature=0.0, timeout_ms=TIMEOUT_MS
                )
                for piece in stream:
                    if first is None and piece:
                        first = time.monotonic()
                done = time.monotonic()
                assert stream.result is not None
                usage = stream.result.usage
                tokens, cached = int(usage["completion_tokens"]), usage.get("cached_tokens")
                return Outcome((first or done) - start, done - start, tokens, cached)

            yield ask


# ---------------------------------------------------------------------- direct llama-cpp-python


def serve_direct(model: str, threads: int, repack: bool, flash_attn: bool | None) -> None:
    """The direct backend's subprocess: one ``Llama``, requests from stdin one at a time.

    Reads JSON lines ``{"id", "prompt", "max_tokens"}``; writes ``{"id", "text": true}``
    per streamed chunk with text and ``{"id", "tokens"}`` at the end, after one
    ``{"ready": true}`` once loaded.
    """
    import llama_cpp

    from node.llama.engine import _model_params  # the node's own use_extra_bufts switch

    extra: dict[str, Any] = {} if flash_attn is None else {"flash_attn": flash_attn}
    with _model_params(repack):
        llm = llama_cpp.Llama(
            model_path=model,
            n_ctx=N_CTX,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            **extra,
        )
    out = sys.stdout

    def emit(msg: dict[str, Any]) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()

    # Count what the model generates: every token ``generate`` yields, less a final
    # end-of-generation token (sampled, not part of the completion), as usage counts.
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    generated: list[int] = []
    original = llm.generate

    def counting(*args: Any, **kwargs: Any) -> Iterator[int]:
        for token in original(*args, **kwargs):
            generated.append(token)
            yield token

    llm.generate = counting  # type: ignore[method-assign,assignment]
    emit({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        generated.clear()
        finish = None
        chunks = llm.create_completion(
            req["prompt"], max_tokens=req["max_tokens"], temperature=0.0, stream=True
        )
        for chunk in cast(Iterator[dict[str, Any]], chunks):
            choice = chunk["choices"][0]
            if choice["text"]:
                emit({"id": req["id"], "text": True})
            finish = choice["finish_reason"] or finish
        eog = bool(generated) and llama_cpp.llama_vocab_is_eog(vocab, generated[-1])
        emit({"id": req["id"], "tokens": len(generated) - eog, "finish": finish})


class DirectBackend(Backend):
    """llama-cpp-python in a subprocess, one request at a time (FIFO)."""

    def __init__(
        self,
        model: Path,
        threads: int,
        cpus: Sequence[int],
        nice: int,
        repack: bool,
        flash_attn: str,
        tmp: Path,
    ) -> None:
        self.name = "direct" if repack else "direct -nr"
        self.flash_attn = flash_attn
        self.model, self.threads, self.cpus, self.nice = model, threads, cpus, nice
        self.repack, self.log = repack, tmp / f"direct-{'r' if repack else 'nr'}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.inboxes: dict[int, queue.Queue[dict[str, Any]]] = {}
        self.next_id = 0

    def start(self, level: int) -> list[int]:
        argv = module_command("node.bench.backends", str(self.model))
        argv += ["--threads", str(self.threads), "--repack", "on" if self.repack else "off"]
        argv += ["--flash-attn", self.flash_attn]
        self.proc = spawn(
            argv, self.cpus, self.nice, self.log, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"direct backend died: {self.log.read_text()[-2000:]}")
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()
        return [self.proc.pid]

    def _read(self, stdout: IO[bytes]) -> None:
        for line in stdout:
            msg = json.loads(line)
            with self.lock:
                box = self.inboxes.get(msg["id"])
            if box is not None:
                box.put(msg)

    def stop(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()  # the loop ends, the process exits
            end(self.proc)
            self.proc = None

    def details(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "n_ctx": N_CTX,
            "repack": self.repack,
            "flash_attn": self.flash_attn,
        }

    @contextlib.contextmanager
    def session(self) -> Iterator[Ask]:
        def ask(prompt: str, max_tokens: int) -> Outcome:
            assert self.proc is not None and self.proc.stdin is not None
            box: queue.Queue[dict[str, Any]] = queue.Queue()
            line = {"prompt": prompt, "max_tokens": max_tokens}
            with self.lock:
                rid = self.next_id
                self.next_id += 1
                self.inboxes[rid] = box
                start = time.monotonic()
                self.proc.stdin.write(json.dumps({"id": rid, **line}).encode() + b"\n")
                self.proc.stdin.flush()
            first: float | None = None
            while "tokens" not in (msg := box.get(timeout=TIMEOUT_MS / 1000)):
                if first is None:
                    first = time.monotonic()
            done = time.monotonic()
            with self.lock:
                del self.inboxes[rid]
            return Outcome((first or done) - start, done - start, int(msg["tokens"]))

        yield ask


# ---------------------------------------------------------------------- llama-server


class ServerBackend(Backend):
    """llama.cpp's llama-server with ``--parallel level``, restarted per level."""

    def __init__(
        self,
        binary: Path,
        model: Path,
        threads: int,
        cpus: Sequence[int],
        nice: int,
        repack: bool,
        extra: Sequence[str],
        tmp: Path,
    ) -> None:
        self.name = "llama-server" if repack else "llama-server -nr"
        self.binary, self.model, self.threads, self.cpus, self.nice = (
            binary,
            model,
            threads,
            cpus,
            nice,
        )
        self.flags = ([] if repack else ["--no-repack"]) + list(extra)
        self.log = tmp / f"llama-server-{'r' if repack else 'nr'}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.argv: list[str] = []
        self.level = 0
        self.props: dict[str, Any] = {}

    def start(self, level: int) -> list[int]:
        self.port, self.level = free_port(), level
        t = str(self.threads)
        self.argv = [str(self.binary), "-m", str(self.model), "-t", t, "-tb", t]
        self.argv += ["--parallel", str(level), "-c", str(level * N_CTX)]
        self.argv += ["--host", "127.0.0.1", "--port", str(self.port), *self.flags]
        self.log.write_bytes(b"")
        self.proc = spawn(self.argv, self.cpus, self.nice, self.log, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited: {self.log.read_text()[-3000:]}")
            with contextlib.suppress(OSError, http.client.HTTPException):
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    conn.close()
                    self.props = self._props()
                    return [self.proc.pid]
                conn.close()
            time.sleep(0.2)
        raise TimeoutError(f"llama-server not healthy in 180 s: {self.log.read_text()[-3000:]}")

    def _props(self) -> dict[str, Any]:
        """The server's build and slot count (GET /props)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/props")
            props = json.loads(conn.getresponse().read())
        finally:
            conn.close()
        return {k: props.get(k) for k in ("build_info", "total_slots")}

    def stop(self) -> None:
        if self.proc is not None:
            end(self.proc)
            self.proc = None

    def details(self) -> dict[str, Any]:
        shown = {"--parallel": "N", "-c": f"N*{N_CTX}", "--port": "PORT"}
        argv = [
            shown.get(prev, a) for prev, a in zip(["", *self.argv[:-1]], self.argv, strict=True)
        ]
        return {"argv": argv, "build_info": self.props.get("build_info")}

    @contextlib.contextmanager
    def session(self) -> Iterator[Ask]:
        def ask(prompt: str, max_tokens: int) -> Outcome:
            body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "stream": True}
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=TIMEOUT_MS / 1000)
            try:
                start = time.monotonic()
                conn.request(
                    "POST", "/completion", json.dumps(body), {"Content-Type": "application/json"}
                )
                resp = conn.getresponse()
                if resp.status != 200:
                    raise RuntimeError(f"llama-server: {resp.status} {resp.read()[:500]!r}")
                first: float | None = None
                for raw in resp:
                    if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                        continue
                    msg = json.loads(raw[6:])
                    if first is None and msg.get("content"):
                        first = time.monotonic()
                    if msg.get("stop"):
                        done = time.monotonic()
                        timings = msg.get("timings", {})
                        tokens = timings.get("predicted_n", msg.get("tokens_predicted"))
                        cached = timings.get("cache_n")
                        return Outcome((first or done) - start, done - start, int(tokens), cached)
                raise RuntimeError("llama-server's stream ended without a stop message")
            finally:
                conn.close()

        yield ask


def main() -> None:
    """The direct backend's subprocess (``DirectBackend.start``): MODEL and how to load it."""
    parser = argparse.ArgumentParser(description="serve_direct: one Llama, requests on stdin")
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--repack", choices=("on", "off"), required=True)
    parser.add_argument("--flash-attn", choices=("default", "on", "off"), required=True)
    args = parser.parse_args()
    flash_attn = None if args.flash_attn == "default" else args.flash_attn == "on"
    serve_direct(args.model, args.threads, args.repack == "on", flash_attn)


if __name__ == "__main__":
    main()
