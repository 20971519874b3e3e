"""Whether a lost worker's requests are run again: the poison-request rule.

A worker lost while running requests gets each of them re-dispatched once,
unless its exit blames the request it was running (``blames_its_request``):
a poison request must not take every worker down in turn. The core applies
the rule when it loses a worker (``broker.core.Broker``).
"""

from __future__ import annotations

from broker.kinds import EngineKind

#: Signals of a crash inside the worker's own (native) code, as the supervisor
#: words them ("killed by SIGSEGV", node.supervisor.describe_exit). The request
#: it was running is the likeliest cause (a grammar llama.cpp cannot parse
#: dereferenced a null pointer: found in a break-it session), so it is not
#: re-dispatched: a poison request would take every worker down in turn. A
#: plain SIGKILL (kill -9, our own verdicts) or a missed heartbeat says nothing
#: about the request, which is re-dispatched once as before.
CRASH_SIGNALS = ("SIGSEGV", "SIGBUS", "SIGILL", "SIGFPE", "SIGABRT")

#: How the node words an OOM kill the worker's cgroup recorded (node.pool), in
#: place of the SIGKILL alone. A worker's cgroup holds that worker and its one
#: sequence, so what outgrew the limit is the running request's memory (its
#: KV, a json_schema's grammar): run again on an identical worker it was
#: OOM-killed there too (break-it session, memory_max 256M and a schema).
OOM_KILLED = "OOM-killed in its cgroup"


def crashed_running_it(reason: str) -> bool:
    """Whether a worker's exit ``reason`` blames what it was running: a native
    crash (``CRASH_SIGNALS``) or an OOM kill in its cgroup (``OOM_KILLED``)."""
    return OOM_KILLED in reason or any(f"killed by {name}" in reason for name in CRASH_SIGNALS)


def blames_its_request(
    reason: str, running: int, kind: EngineKind = "llm", *, failure: bool = True
) -> bool:
    """Whether a lost worker's request is the poison one, never to be run again.

    A crash or OOM kill (``crashed_running_it``) with one request in flight blames
    that request. With several (an S-slot worker) none can be told from the
    others, so none is blamed: each that streamed nothing is re-dispatched once,
    like any lost request, and a request is never re-dispatched twice. A poison
    request therefore takes down at most two workers: the one it shared, and
    the one it was retried on.

    A rule worker lost by a failure (dead, stalled, hung, exited; not a clean
    DISCONNECT, a replacement or the node stopping: ``failure``) with one request
    in flight blames it whatever the reason: the rule engine is deterministic and
    answers in microseconds, so what stopped it was that request, and the
    restarted rule worker would die of it too (issue 11: a catastrophic regex
    killed the rule worker twice). An operator's SIGSTOP during those
    microseconds is the only false verdict, and costs that one request.
    """
    if running != 1:
        return False
    if kind == "rules":
        return failure
    return crashed_running_it(reason)
