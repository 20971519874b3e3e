"""A worker's exit cause: its words (what replies, logs and status show) and the
retry decision each cause makes, read from fields, never from the words."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any, get_args

import pytest

from broker.errors import ErrorCode
from broker.exits import (
    CRASH_SIGNALS,
    KILL_VERDICTS,
    VERDICT_WORDS,
    ExitCause,
    Verdict,
    blames_its_request,
    not_retried,
)
from broker.kinds import FinalOutcome
from broker.replies import ERROR_OUTCOMES
from node.engine import EngineSpec
from node.supervisor import Supervisor, WorkerHandle, exit_cause
from node.worker import EXIT_CONFIG, EXIT_ENGINE_BUG, EXIT_MODEL_LOAD, WorkerSpec

OOM = ExitCause(signal="SIGKILL", oom_killed=True, memory_max="64 MiB")


@pytest.mark.parametrize(
    ("cause", "words"),
    [
        (ExitCause("dead"), "dead: missed heartbeats"),
        (ExitCause("stalled"), "stalled: no progress while busy"),
        (ExitCause("hung"), "hung: no ack to CANCEL within the grace"),
        (ExitCause("not_ready", detail="30s"), "not READY within 30s"),
        (ExitCause("disconnected"), "disconnected"),
        (ExitCause("replaced"), "replaced by a new incarnation"),
        (ExitCause("protocol_error", detail="bad frame"), "protocol error: bad frame"),
        (
            ExitCause("dead", at_limit="working set 61 MiB of memory.max 64 MiB"),
            "dead: missed heartbeats, at its memory limit"
            " (working set 61 MiB of memory.max 64 MiB)",
        ),
        (ExitCause(signal="SIGSEGV"), "killed by SIGSEGV"),
        (ExitCause(signal="signal 99"), "killed by signal 99"),
        (ExitCause(code=0), "exit 0"),
        (ExitCause(code=70), "exit 70"),
        (
            ExitCause(code=66, deterministic=True, meaning="model failed to load"),
            "exit 66: model failed to load",
        ),
        (
            ExitCause(code=66, deterministic=True, meaning="rules failed to load", message="x: y"),
            "exit 66: rules failed to load: x: y",
        ),
        (OOM, "OOM-killed in its cgroup at memory.max 64 MiB (killed by SIGKILL)"),
        (
            ExitCause("hung", signal="SIGKILL"),
            "hung: no ack to CANCEL within the grace (killed by SIGKILL)",
        ),
        (
            ExitCause("dead", at_limit="working set 61 MiB of memory.max 64 MiB", signal="SIGKILL"),
            "dead: missed heartbeats, at its memory limit"
            " (working set 61 MiB of memory.max 64 MiB) (killed by SIGKILL)",
        ),
        (
            ExitCause("stalled", signal="SIGKILL", oom_killed=True, memory_max="its limit"),
            "stalled: no progress while busy"
            " (OOM-killed in its cgroup at memory.max its limit (killed by SIGKILL))",
        ),
        (ExitCause(), ""),
    ],
)
def test_every_cause_is_worded_as_before(cause: ExitCause, words: str) -> None:
    assert cause.describe() == words


def test_every_verdict_has_words() -> None:
    assert set(VERDICT_WORDS) == set(get_args(Verdict))
    assert set(KILL_VERDICTS) <= set(VERDICT_WORDS)


@pytest.mark.parametrize("signal", CRASH_SIGNALS)
def test_a_native_crash_running_one_request_blames_it(signal: str) -> None:
    cause = ExitCause(signal=signal)
    assert cause.crashed and blames_its_request(cause, 1, "llm")
    assert not blames_its_request(cause, 2, "llm")  # an S-slot worker: none is blamed
    assert not blames_its_request(cause, 0, "llm")
    assert not_retried(cause, "llm") == "not retried: the worker crashed running this request"


def test_an_oom_kill_running_one_request_blames_it() -> None:
    assert OOM.crashed and blames_its_request(OOM, 1, "llm")
    assert not blames_its_request(OOM, 3, "llm")


def test_an_oom_kill_by_a_limit_above_the_workers_cgroup_blames_nothing() -> None:
    """The node's (or a parent's) limit lowered under what its workers hold: the
    kernel kills the largest task in the node's tree, a worker whose own cgroup was
    nowhere near its memory.max. Its message named that memory.max, and its request
    was blamed as the poison one and never run again."""
    above = ExitCause(
        signal="SIGKILL", oom_killed=True, memory_max="256 MiB", oom_above=True, oom_peak="90 MiB"
    )
    assert above.describe() == (
        "OOM-killed by a memory limit above its cgroup (peak 90 MiB, memory.max 256 MiB)"
        " (killed by SIGKILL)"
    )
    assert not above.crashed and not blames_its_request(above, 1, "llm")
    unlimited = ExitCause(signal="SIGKILL", oom_killed=True, oom_above=True, oom_peak="90 MiB")
    assert unlimited.describe() == (
        "OOM-killed by a memory limit above its cgroup (peak 90 MiB, no memory.max of its own)"
        " (killed by SIGKILL)"
    )
    assert not_retried(OOM, "llm") == (
        "not retried: the worker ran out of memory running this request"
    )


@pytest.mark.parametrize(
    "cause",
    [
        ExitCause(signal="SIGKILL"),
        ExitCause(signal="SIGTERM"),
        ExitCause(signal="signal 99"),
        ExitCause(code=0),
        ExitCause(code=EXIT_ENGINE_BUG),
        ExitCause(code=EXIT_MODEL_LOAD, deterministic=True, meaning="model failed to load"),
        *(ExitCause(verdict) for verdict in get_args(Verdict)),
        ExitCause("hung", signal="SIGKILL"),
    ],
)
def test_other_causes_say_nothing_about_a_model_request(cause: ExitCause) -> None:
    assert not cause.crashed and not blames_its_request(cause, 1, "llm")


@pytest.mark.parametrize(
    "cause",
    [ExitCause("dead"), ExitCause("stalled"), ExitCause(code=1), ExitCause(signal="SIGKILL")],
)
def test_a_rule_worker_failing_on_one_request_blames_it_whatever_the_cause(
    cause: ExitCause,
) -> None:
    assert blames_its_request(cause, 1, "rules")
    assert not blames_its_request(cause, 1, "rules", failure=False)  # DISCONNECT, node stopping
    assert not_retried(cause, "rules") == (
        "not retried: the rule engine failed running this request"
    )


def test_the_supervisor_states_a_returncode_as_a_cause() -> None:
    assert exit_cause(-11) == ExitCause(signal="SIGSEGV")
    assert exit_cause(-9) == ExitCause(signal="SIGKILL")
    assert exit_cause(-99).describe() == "killed by signal 99"
    assert exit_cause(0) == ExitCause(code=0)
    assert exit_cause(EXIT_ENGINE_BUG) == ExitCause(code=EXIT_ENGINE_BUG)
    assert exit_cause(EXIT_MODEL_LOAD, "rules", "bad.toml: not valid TOML").describe() == (
        "exit 66: rules failed to load: bad.toml: not valid TOML"
    )
    assert exit_cause(EXIT_MODEL_LOAD).describe() == "exit 66: model failed to load"
    config = exit_cause(EXIT_CONFIG)
    assert config.deterministic and config.describe() == "exit 78: bad worker configuration"


def _supervisor(
    tmp_path: Path, **settings: Any
) -> tuple[Supervisor, WorkerHandle, list[tuple[str, ExitCause]]]:
    """One test-engine worker ``llm-0`` (never spawned); ``settings`` override the
    Supervisor's (no restart delay by default)."""
    engine = EngineSpec(kind="test", model_path="test", n_ctx=64, n_batch=64, threads=1)
    exits: list[tuple[str, ExitCause]] = []
    sup = Supervisor(
        [WorkerSpec("llm-0", "ipc:///nowhere", engine)],
        tmp_path,
        **({"ready_timeout_s": 30, "backoff_s": 0, "backoff_max_s": 0} | settings),
        on_exit=lambda wid, cause: exits.append((wid, cause)),
    )
    return sup, sup.handles["llm-0"], exits


def test_a_process_killed_for_a_verdict_exits_with_it(tmp_path: Path) -> None:
    sup, handle, exits = _supervisor(tmp_path)
    handle.kill_cause = ExitCause("dead", at_limit="working set 61 MiB of memory.max 64 MiB")
    sup._reaped(handle, -9, 1.0)
    ((wid, cause),) = exits
    assert (wid, cause.verdict, cause.signal) == ("llm-0", "dead", "SIGKILL")
    assert (
        handle.last_exit
        == cause.describe()
        == (
            "dead: missed heartbeats, at its memory limit"
            " (working set 61 MiB of memory.max 64 MiB) (killed by SIGKILL)"
        )
    )
    assert handle.state == "restarting"


def test_a_process_that_exits_by_itself_keeps_its_own_cause(tmp_path: Path) -> None:
    sup, handle, exits = _supervisor(tmp_path)
    handle.kill_cause = ExitCause("not_ready", detail="30s")
    sup._reaped(handle, 0, 1.0)
    assert exits == [("llm-0", ExitCause(code=0))] and handle.last_exit == "exit 0"


def test_a_deterministic_exit_is_not_restarted(tmp_path: Path) -> None:
    sup, handle, exits = _supervisor(tmp_path)
    (tmp_path / "llm-0.exit").write_text("model.gguf: no such file\n")
    sup._reaped(handle, EXIT_MODEL_LOAD, 1.0)
    ((_, cause),) = exits
    assert cause.deterministic and handle.state == "failed"
    assert handle.last_exit == "exit 66: model failed to load: model.gguf: no such file"


@pytest.mark.parametrize("verdict", KILL_VERDICTS)
def test_the_supervisor_takes_its_state_from_the_verdict(tmp_path: Path, verdict: Verdict) -> None:
    sup, handle, _ = _supervisor(tmp_path)
    handle.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        sup.worker_lost("llm-0", handle.proc.pid, ExitCause(verdict))
        assert handle.proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        handle.proc.kill()
    assert (handle.state, handle.last_exit) == (verdict, VERDICT_WORDS[verdict])
    assert handle.kill_cause == ExitCause(verdict)


def test_every_error_code_has_its_outcome() -> None:
    assert set(ERROR_OUTCOMES) == set(ErrorCode)
    assert {f"error_{code.name.lower()}" for code in ErrorCode} == set(ERROR_OUTCOMES.values())
    assert set(get_args(FinalOutcome)) == {"ok", *ERROR_OUTCOMES.values()}


def test_a_worker_lost_soon_after_ready_backs_off_and_a_good_run_starts_anew(
    tmp_path: Path,
) -> None:
    # The backoff started anew at every READY, so a worker killed right after it each
    # time (heartbeats of 1 ms x 1) was restarted every 0.5 s: 284 times in 2.5 min
    # (break-it pass, session 19). Now a local worker needs a good run, as a host
    # agent's does: registered for restart_backoff_max_ms.
    now = [0.0]
    sup, handle, _ = _supervisor(tmp_path, backoff_s=0.5, backoff_max_s=30, clock=lambda: now[0])
    delays = []
    for up_s in (1.0, 1.0, 1.0, 31.0, 1.0):
        handle.proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
        try:
            handle.ready_at = None  # as at a spawn
            sup.worker_ready("llm-0", handle.proc.pid)
            now[0] += up_s
        finally:
            handle.proc.kill()
            handle.proc.wait()
        sup._reaped(handle, -9, now[0])
        assert handle.restart_at is not None
        delays.append(handle.restart_at - now[0])
        now[0] = handle.restart_at
    assert delays == [0.5, 1.0, 2.0, 0.5, 1.0]
