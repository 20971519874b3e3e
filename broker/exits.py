"""Why a worker is gone, as the node's supervisor and the broker both state it.

``ExitCause`` is part of the broker <-> supervisor contract, like
``broker.records.WorkerEvent``: the node fills it in when it reaps a worker's
process (``node.supervisor.exit_cause``, the OOM kill its cgroup recorded from
``node.pool``), the broker when it gives up on a worker itself (a liveness
verdict, a clean DISCONNECT, a replaced incarnation). Decisions read its fields
(``blames_its_request``); ``describe`` words it for replies, logs and status.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from broker.kinds import EngineKind

#: Who gave up on a worker, and why, when it was not its process's own doing:
#: the broker's liveness verdicts (``dead``: silent for liveness x interval;
#: ``stalled``: busy with a frozen progress counter; ``hung``: no ack to CANCEL),
#: the supervisor's ``not_ready`` (no READY within its timeout), and the broker's
#: losses that kill nothing (``disconnected``, ``replaced`` by a new incarnation,
#: ``protocol_error``).
Verdict = Literal[
    "dead", "stalled", "hung", "not_ready", "disconnected", "replaced", "protocol_error"
]

#: The verdicts on which the supervisor kills the worker's process (``WorkerEvent`` ``lost``).
KILL_VERDICTS: tuple[Verdict, ...] = ("dead", "stalled", "hung")

#: Each verdict in words; ``{detail}`` is ``ExitCause.detail``.
VERDICT_WORDS: dict[Verdict, str] = {
    "dead": "dead: missed heartbeats",
    "stalled": "stalled: no progress while busy",
    "hung": "hung: no ack to CANCEL within the grace",
    "not_ready": "not READY within {detail}",
    "disconnected": "disconnected",
    "replaced": "replaced by a new incarnation",
    "protocol_error": "protocol error: {detail}",
}

#: Signals of a crash inside the worker's own (native) code. The request it was
#: running is the likeliest cause (a grammar llama.cpp could not parse), so it is
#: not re-dispatched: a poison request would take every worker down in turn. A
#: plain SIGKILL (kill -9, our own verdicts) says nothing about the request.
CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")


@dataclass(frozen=True)
class ExitCause:
    """Why a worker is gone: a verdict, its process's exit, or both.

    A process killed after a verdict carries both (``dead`` and ``SIGKILL``); one
    that exited by itself carries only its exit, even if a verdict was on its way.

    Attributes:
        verdict: who gave up on it and why (``Verdict``), or None.
        detail: the verdict's particulars, for people only: a protocol error's
            message, the READY timeout ("30s").
        at_limit: set when a kill verdict found the worker at its cgroup's memory
            limit (stuck in reclaim, most likely): "working set 61 MiB of memory.max
            64 MiB".
        signal: the name of the signal that ended the process ("SIGSEGV"), or
            "signal N" for a number without a name; None if it exited.
        code: the exit status of a process that exited by itself, or None.
        deterministic: ``code`` is one of the worker's own exits that a new
            process would repeat (``node.worker.DETERMINISTIC_EXITS``).
        meaning: what a deterministic ``code`` means ("model failed to load"), or "".
        message: the worker's own one-line reason for a deterministic exit, or "".
        oom_killed: its cgroup recorded an OOM kill during this process's life.
        memory_max: its cgroup's limit, as the node words it ("64 MiB"), or "" if
            it has none.
        oom_above: the OOM kill came from a limit above its cgroup (the node's, a
            parent's, the machine's), as the node judged from the kernel's counts
            since the process was spawned (``node.sandbox.driver.killed_by_own_limit``).
        oom_peak: its peak memory then, as the node words it ("38 MiB"), or "".
    """

    verdict: Verdict | None = None
    detail: str = ""
    at_limit: str = ""
    signal: str | None = None
    code: int | None = None
    deterministic: bool = False
    meaning: str = ""
    message: str = ""
    oom_killed: bool = False
    memory_max: str = ""
    oom_above: bool = False
    oom_peak: str = ""

    @property
    def crashed(self) -> bool:
        """Whether it blames what the process was running: a native crash
        (``CRASH_SIGNALS``) or an OOM kill at its own cgroup's limit, which holds
        that worker alone, so what outgrew the limit was its request's memory (its
        KV, a json_schema's grammar) and an identical worker would die of it too
        (test_core_poison, tests/system/test_isolation.py). A kill by a limit above
        it (``oom_above``) blames nothing: the node as a whole ran out."""
        return (self.oom_killed and not self.oom_above) or self.signal in CRASH_SIGNALS

    def describe(self) -> str:
        """The cause in words, as replies, logs and status show it.

        "dead: missed heartbeats", "killed by SIGSEGV", "exit 66: model failed to
        load: <message>", "OOM-killed in its cgroup at memory.max 64 MiB (killed by
        SIGKILL)"; a verdict that killed the process comes first, its exit in
        parentheses: "hung: no ack to CANCEL within the grace (killed by SIGKILL)".
        """
        verdict = self._verdict_words()
        process = self._process_words()
        if process is None:
            return verdict or ""
        return process if verdict is None else f"{verdict} ({process})"

    def _verdict_words(self) -> str | None:
        if self.verdict is None:
            return None
        words = VERDICT_WORDS[self.verdict].format(detail=self.detail)
        return f"{words}, at its memory limit ({self.at_limit})" if self.at_limit else words

    def _process_words(self) -> str | None:
        if self.signal is not None:
            words = f"killed by {self.signal}"
        elif self.code is not None:
            words = f"exit {self.code}"
            if self.meaning:
                words += f": {self.meaning}"
                if self.message:
                    words += f": {self.message}"
        else:
            return None
        if self.oom_killed and self.oom_above:
            own = f"memory.max {self.memory_max}" if self.memory_max else "no memory.max of its own"
            peak = f"peak {self.oom_peak}, " if self.oom_peak else ""
            words = f"OOM-killed by a memory limit above its cgroup ({peak}{own}) ({words})"
        elif self.oom_killed:
            words = f"OOM-killed in its cgroup at memory.max {self.memory_max} ({words})"
        return words


def blames_its_request(
    cause: ExitCause, running: int, kind: EngineKind = "llm", *, failure: bool = True
) -> bool:
    """Whether a lost worker's request is the poison one, never to be run again.

    A crash or OOM kill (``ExitCause.crashed``) with one request in flight blames
    that request. With several (an S-slot worker) none can be told from the
    others, so none is blamed: each that streamed nothing is re-dispatched once,
    like any lost request, and a request is never re-dispatched twice. A poison
    request therefore takes down at most two workers: the one it shared, and
    the one it was retried on.

    A rule worker lost by a failure (dead, stalled, hung, exited; not a clean
    DISCONNECT, a replacement or the node stopping: ``failure``) with one request
    in flight blames it whatever the cause: the rule engine is deterministic and
    answers in microseconds, so what stopped it was that request, and the
    restarted rule worker would die of it too (test_core_rules_poison). An
    operator's SIGSTOP during those microseconds is the only false verdict.
    """
    if running != 1:
        return False
    if kind == "rules":
        return failure
    return cause.crashed


def not_retried(cause: ExitCause, kind: EngineKind) -> str:
    """Why a blamed request is not run again, in the words its reply ends with."""
    if kind == "rules":
        return "not retried: the rule engine failed running this request"
    if cause.oom_killed:
        return "not retried: the worker ran out of memory running this request"
    return "not retried: the worker crashed running this request"
