"""The worker pool on this host: core plan, cgroups, supervisor, rule worker.

``WorkerPool`` owns everything the node does to keep its worker processes
fenced in: it plans cores (``node.sandbox.cores``), opens the node's cgroups
(``node.sandbox.cgroups``) before any zmq thread exists, gives each model worker a
fresh cgroup before every spawn, supervises the processes, adds an OOM kill
seen in a cgroup to a worker's exit cause, and removes every cgroup on stop.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path

from broker.exits import ExitCause
from node.capacity.plan import resolve_slots
from node.capacity.worker_limits import PlannedLimits
from node.config import NodeConfig
from node.endpoints import connect_endpoint
from node.engine import EngineName, EngineSpec
from node.sandbox.cgroups import Sandbox, cgroup_name, limits_for, options_for
from node.sandbox.cores import CpuPlan, cores_line, pin_all_threads, plan_workers
from node.sandbox.driver import MemoryReading, killed_by_own_limit
from node.sandbox.niceness import NO_NICENESS, process_niceness
from node.sandbox.oom import oom_score_adj
from node.supervisor import ProcessStatus, Supervisor
from node.units import format_size
from node.worker import WorkerSpec

log = logging.getLogger("edgenode.pool")

RULES_WORKER = "rules-0"


class WorkerStatus(ProcessStatus):
    """One worker's row of ``edgenode status``'s "processes": its process
    (``ProcessStatus``), then its sandbox and layout."""

    cgroup: str | None
    memory: dict[str, int | bool | None] | None
    oom_kills: int
    cpus: list[int]
    threads: int
    slots: int
    engine: EngineName
    nice: int | None
    autogroup_nice: int | None
    #: µs; the main thread's scheduler slice, None = the kernel's default (node.sandbox.niceness).
    slice_us: int | None
    #: /proc/<pid>/oom_score_adj (node.sandbox.oom), None without a process.
    oom_score_adj: int | None


class WorkerPool:
    """The model workers (``llm-N``) and the rule worker (``rules-0``) of one node.

    Args:
        config: the node's configuration.
        model_path: the resolved GGUF file (or "test" for the test engine).
        rules_path: the rules file the rule worker loads (the node gives it the
            snapshot it validated at start, ``node.model.snapshot_rules``), or None
            for no rule worker.
        run_dir: logs go to ``<run_dir>/logs``; the cgroup name derives from it.
        capacity: the capacity plan (``node.capacity.plan.check_fits``), whose limits
            ``workers.memory_max = "auto"`` gives every model worker's cgroup.
        slots: sequences per model worker (the plan's ``slots``); None resolves
            ``workers.slots`` with ``node.capacity.plan.resolve_slots``. The rule
            worker always has one.
        backend_key, key_file: a CURVE backend's server public key (Z85) and the
            file of the keypair the workers prove (``node.security.keys.local_keypair``);
            ``b""``: a plaintext backend.
        host: a remote host agent's name (``node.remote.agent``): its model
            workers are ``<host>.llm-N`` and say ``host`` in READY, so the broker
            tells them from the node's own; None for the node's own pool.

    Raises:
        ConfigError: an impossible core reservation (before anything starts).
    """

    def __init__(
        self,
        config: NodeConfig,
        model_path: str,
        rules_path: str | None,
        run_dir: Path,
        capacity: PlannedLimits | None = None,
        slots: int | None = None,
        backend_key: bytes = b"",
        key_file: Path | None = None,
        host: str | None = None,
        embedded: bool = False,
    ) -> None:
        self.config = config
        self.host = host
        #: A CURVE backend's server public key (Z85) and the workers' keypair file.
        self._server_key = backend_key.decode()
        self._key_file = str(key_file) if backend_key and key_file else ""
        self.capacity = capacity
        self.slots = resolve_slots(config) if slots is None else slots
        w = config.workers
        self.plan: CpuPlan = plan_workers(w, config.node.cpus, embedded=embedded)
        #: The plan as status shows it (``CpuPlan.describe``): made once, never changes.
        self.cores = self.plan.describe(w.cpus)
        self.sandbox = Sandbox(options_for(w, self.plan, cgroup_name(run_dir)))
        self.specs = self._model_specs(model_path)
        if rules_path is not None:
            self.specs.append(self._rules_spec(rules_path))
        self.oom_kills: dict[str, int] = {}
        # Each worker's cgroup read when its current process was spawned: a restart
        # reuses the cgroup, whose counters never go down (the OOM kills, and the
        # evidence of whose limit did it: killed_by_own_limit).
        self._at_spawn: dict[str, MemoryReading] = {}
        self.supervisor = Supervisor(
            self.specs,
            log_dir=run_dir / "logs",
            ready_timeout_s=w.ready_timeout_ms / 1000,
            backoff_s=w.restart_backoff_ms / 1000,
            backoff_max_s=w.restart_backoff_max_ms / 1000,
            log_level=config.node.log_level,
            log_format=config.logging.format,
            prepare=self._prepare,
            explain=self._explain,
            log_max_bytes=w.log_max_bytes,
        )

    def _model_specs(self, model_path: str) -> list[WorkerSpec]:
        c = self.config
        specs = []
        for placement in self.plan.workers:
            engine = EngineSpec(
                kind=c.workers.engine,
                model_path=model_path,
                n_ctx=c.model.n_ctx,
                n_batch=c.model.n_batch,
                threads=placement.threads,
                chat_format=c.model.chat_format,
                repack=c.model.repack,
                kv_type=c.model.kv_type,
                flash_attn=c.model.flash_attn,
                slots=self.slots,
                adaptive_threads=c.workers.adaptive_threads,
                test_token_ms=c.workers.test_token_ms,
                test_load_ms=c.workers.test_load_ms,
            )
            specs.append(
                WorkerSpec(
                    worker_id=("" if self.host is None else f"{self.host}.")
                    + f"llm-{placement.index}",
                    backend=connect_endpoint(c.backend),
                    engine=engine,
                    slots=self.slots,
                    heartbeat_interval_ms=c.broker.heartbeat_interval_ms,
                    heartbeat_liveness=c.broker.heartbeat_liveness,
                    # Pinned to its planned cores when they are fewer than the node's, or
                    # when the node is pinned itself: a worker would inherit its cores.
                    cpus=placement.cpus if self.plan.restricts or self.plan.node else (),
                    nice=placement.nice,
                    slice_us=c.workers.slice_us,
                    oom_score_adj=c.workers.oom_score_adj,
                    max_body_bytes=c.broker.max_body_bytes,
                    curve_server_key=self._server_key,
                    curve_key_file=self._key_file,
                    info={} if self.host is None else {"host": self.host},
                )
            )
        return specs

    def _rules_spec(self, rules_path: str) -> WorkerSpec:
        """The rule worker: tiny, one slot, on the node's cores at nice 0, ahead of the model."""
        c = self.config
        engine = EngineSpec(kind="rules", model_path=rules_path, n_ctx=0, n_batch=0, threads=1)
        return WorkerSpec(
            worker_id=RULES_WORKER,
            backend=connect_endpoint(c.backend),
            engine=engine,
            slots=1,
            heartbeat_interval_ms=c.broker.heartbeat_interval_ms,
            heartbeat_liveness=c.broker.heartbeat_liveness,
            cpus=self.plan.node,
            max_body_bytes=c.broker.max_body_bytes,
            curve_server_key=self._server_key,
            curve_key_file=self._key_file,
        )

    # ------------------------------------------------------------------ lifecycle

    def open(self) -> None:
        """Open the cgroups (before any zmq context: joining a cpuset can reset the
        affinity of every thread) and reap a crashed run's leftovers.

        Raises:
            SandboxError: ``sandbox = "required"`` and cgroups cannot be used.
        """
        self.sandbox.open()
        log.info("%s", cores_line(self.cores))
        if self.plan.node:
            # The broker (and its zmq threads, created later) stays on the node's
            # cores: the host's never see a token relayed (node/sandbox/cores.py).
            pin_all_threads(self.plan.node)
        self._prefault()

    def _prefault(self) -> None:
        """Read the mmapped model once from the node's own cgroup.

        The kernel charges a page-cache page to the cgroup that first touches it.
        Shared weights belong in the node's budget, counted once: were the first
        worker to fault them in, its private limit would have to hold them all.
        """
        spec = self.specs[0].engine if self.specs else None
        if spec is None or spec.kind != "llama" or spec.repack or not self.sandbox.active:
            return
        with open(spec.model_path, "rb", buffering=0) as fh:
            while fh.read(1 << 20):
                pass

    def start(self, on_exit: Callable[[str, ExitCause], None]) -> None:
        """Spawn every worker; ``on_exit(worker_id, cause)`` hears of each exit."""
        self.supervisor.on_exit = on_exit
        self.supervisor.start()

    def stop(self, grace_s: float) -> None:
        """Stop the workers, then remove every cgroup (killing stragglers)."""
        try:
            self.supervisor.stop(grace_s)
        finally:
            self.sandbox.close()

    def _prepare(self, spec: WorkerSpec) -> WorkerSpec:
        """A fresh cgroup for a model worker's next incarnation."""
        if not self.sandbox.active or spec.worker_id == RULES_WORKER:
            return spec
        paths = self.sandbox.create_worker(
            spec.worker_id, limits_for(self.config.workers, spec.cpus, self.capacity)
        )
        reading = self.memory(spec.worker_id)
        if reading is not None:  # unreadable: the last reading stands (the death's)
            self._at_spawn[spec.worker_id] = reading
        return dataclasses.replace(spec, cgroup_procs=paths)

    def _explain(self, worker_id: str, cause: ExitCause) -> ExitCause:
        """``cause`` with the OOM kill the cgroup recorded during this process's
        life, if any (the signal alone says SIGKILL), and whether its own limit or
        one above it did it (``killed_by_own_limit``, against the reading taken
        at the spawn)."""
        reading = self.memory(worker_id)
        at_spawn = self._at_spawn.get(worker_id)
        new = 0 if reading is None else reading.oom_kills - (at_spawn.oom_kills if at_spawn else 0)
        if reading is None or new <= 0:
            return cause
        self._at_spawn[worker_id] = reading  # counted: not again
        self.oom_kills[worker_id] = self.oom_kills.get(worker_id, 0) + new
        limit = format_size(reading.limit) if reading.limit is not None else ""
        peak = format_size(reading.peak) if reading.peak is not None else ""
        return dataclasses.replace(
            cause,
            oom_killed=True,
            memory_max=limit,
            oom_above=not killed_by_own_limit(at_spawn, reading),
            oom_peak=peak,
        )

    def lose(self, worker_id: str, pid: int | None, cause: ExitCause) -> None:
        """The broker gave up on ``worker_id`` (``cause``: dead, stalled, hung): kill it.

        A verdict on a worker whose working set was at its cgroup's limit says so
        in the exit cause (``MemoryReading.near_limit``): it was most likely stuck
        in reclaim rather than hung in its own code, and the fix is a larger
        ``workers.memory_max`` or a smaller context, not a shorter timeout.
        """
        reading = self.memory(worker_id) if worker_id != RULES_WORKER else None
        if reading is not None and reading.near_limit and reading.limit is not None:
            at_limit = (
                f"working set {format_size(reading.working_set)}"
                f" of memory.max {format_size(reading.limit)}"
            )
            cause = dataclasses.replace(cause, at_limit=at_limit)
        self.supervisor.worker_lost(worker_id, pid, cause)

    # ------------------------------------------------------------------ readings

    def memory(self, worker_id: str | None = None) -> MemoryReading | None:
        """A worker's (or, with None, the whole node's) cgroup memory, if sandboxed."""
        if not self.sandbox.active:
            return None
        try:
            return self.sandbox.memory(worker_id)
        except OSError:
            return None  # the cgroup is being recreated for a restart

    def status(self) -> list[WorkerStatus]:
        """Per worker: process state, cgroup, memory, OOM kills, cpus, threads, slots,
        nice levels (``nice``, ``autogroup_nice``: see node.sandbox.niceness)."""
        out = []
        for entry, spec in zip(self.supervisor.status(), self.specs, strict=True):
            wid = entry["worker_id"]
            reading = self.memory(wid) if wid != RULES_WORKER else None
            niceness = process_niceness(entry["pid"]) if entry["pid"] else NO_NICENESS
            out.append(
                WorkerStatus(
                    **entry,
                    cgroup=self.sandbox.cgroup_of(wid) if self.sandbox.active else None,
                    memory=reading.as_dict() if reading is not None else None,
                    oom_kills=self.oom_kills.get(wid, 0),
                    cpus=list(spec.cpus),
                    threads=spec.engine.threads,
                    slots=spec.slots,
                    engine=spec.engine.kind,
                    nice=niceness["nice"],
                    autogroup_nice=niceness["autogroup_nice"],
                    slice_us=niceness["slice_us"],
                    oom_score_adj=oom_score_adj(entry["pid"]) if entry["pid"] else None,
                )
            )
        return out
