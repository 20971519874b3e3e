"""``edgenode bench``'s checks before anything runs (``--out``, ``--only``), its refusal of
a taken ``--out``, and what it keeps when the run is cut short: a Ctrl-C, or a report that
cannot be written where asked. The scenarios themselves are not run here
(tests/integration/test_bench.py runs them); where the command would start one, the runner
is replaced by ``NotRun``, which fails the test if it is called when it must not be.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from click.testing import CliRunner

from broker.records import BrokerSettings
from node.bench import faults, outdir, runner
from node.bench.context import BenchContext, NoProgress, split_list
from node.bench.report import Goal, Section
from node.bench.runner import Outcome, Scenario, parse_only, save
from node.cli import bench as bench_cli
from node.cli.main import cli
from node.config import WorkersSection
from node.testing import REPO


class NotRun:
    """Stands in for the runner: records its calls; ``allowed=False`` fails the test if the
    command gets as far as running a scenario."""

    def __init__(self, allowed: bool = False) -> None:
        self.allowed = allowed
        self.calls: list[tuple[Any, ...]] = []

    def __call__(self, names: list[str], out: Path, *rest: Any, **kw: Any) -> Outcome:
        self.calls.append((names, out))
        assert self.allowed, f"the bench started running {names} into {out}"
        header = {"scenarios": ", ".join(names)}
        section = Section("broker", "Broker overhead", "measured", goals=[Goal("g", 1.0, 0, "==")])
        return Outcome(out / "report.md", [section], header)


@pytest.fixture
def not_run(monkeypatch: pytest.MonkeyPatch) -> NotRun:
    fake = NotRun()
    monkeypatch.setattr(bench_cli, "run_bench", fake)
    return fake


def invoke(*args: str) -> Any:
    return CliRunner().invoke(cli, ["bench", "--engine", "test", "--no-progress", *args])


def error_line(output: str) -> str:
    [line] = [x for x in output.splitlines() if x.startswith("Error:")]
    return line


# ----------------------------------------------------------------------------- --out


@pytest.mark.parametrize(
    "where", ["under-a-file", "/proc/edgenode-bench-x", "/sys/edgenode-bench-x", "a-file"]
)
def test_an_unwritable_out_is_refused_before_anything_runs(
    tmp_path: Path, not_run: NotRun, where: str
) -> None:
    (tmp_path / "a-file").write_text("not a directory")
    out = {
        "under-a-file": tmp_path / "a-file" / "report",
        "a-file": tmp_path / "a-file",
    }.get(where, Path(where))
    result = invoke("--only", "broker", "--out", str(out))
    assert result.exit_code == 2, result.output
    line = error_line(result.output)
    assert line.startswith("Error: Invalid value for '--out':"), line
    if where != "a-file":  # that one click's own Path check finds ("is a file")
        assert f"{out}: cannot write the report there (" in line
    assert "Traceback" not in result.output
    assert not_run.calls == []
    assert not out.exists() or where == "a-file"


def test_out_is_made_and_test_written_then_released(tmp_path: Path, not_run: NotRun) -> None:
    not_run.allowed = True
    out = tmp_path / "deep" / "report"
    result = invoke("--only", "broker", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert not_run.calls == [(["broker"], out)]
    assert out.is_dir()
    assert not (out / outdir.LOCK_NAME).exists()  # released after the run


@pytest.mark.parametrize("existing", ["report.md", "report.json"])
def test_an_out_holding_a_report_is_refused_unless_force(
    tmp_path: Path, not_run: NotRun, existing: str
) -> None:
    (tmp_path / existing).write_text("the other run's report")
    result = invoke("--only", "broker", "--out", str(tmp_path))
    assert result.exit_code == 2, result.output
    assert f"already holds a report ({existing})" in error_line(result.output)
    assert "--force" in error_line(result.output)
    assert not_run.calls == []
    assert (tmp_path / existing).read_text() == "the other run's report"
    not_run.allowed = True
    result = invoke("--only", "broker", "--out", str(tmp_path), "--force")
    assert result.exit_code == 0, result.output
    assert not_run.calls == [(["broker"], tmp_path)]


def test_a_bench_writing_into_out_keeps_the_second_out_even_with_force(
    tmp_path: Path, not_run: NotRun
) -> None:
    """Another process holds ``--out`` (a bench still running: no report there yet)."""
    hold = (
        "import sys, pathlib; from node.bench import outdir; "
        "c = outdir.claim(pathlib.Path(sys.argv[1]), False); print('held', flush=True); "
        "sys.stdin.read(); c.release()"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with subprocess.Popen(
        [sys.executable, "-c", hold, str(tmp_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    ) as other:
        assert other.stdout is not None and other.stdin is not None
        assert other.stdout.readline() == "held\n"
        result = invoke("--only", "broker", "--out", str(tmp_path), "--force")
        assert result.exit_code == 2, result.output
        assert f"another edgenode bench (pid {other.pid})" in error_line(result.output)
        other.stdin.close()
        assert other.wait(timeout=30) == 0
    assert not_run.calls == []
    # Once it is done, the directory is free again (and a lock left by a killed bench
    # would not block either: the lock goes with its process).
    held = outdir.claim(tmp_path, False)
    held.release()


# ----------------------------------------------------------------------------- --only


@pytest.mark.parametrize(
    ("only", "message"),
    [
        ("", "no scenario given"),
        ("  ", "no scenario given"),
        (" , ", "no scenario given"),
        ("faults,", "an empty scenario in 'faults,'"),
        ("faults,,broker", "an empty scenario in 'faults,,broker'"),
        (",faults", "an empty scenario in ',faults'"),
    ],
)
def test_an_empty_only_or_an_empty_item_is_an_error(
    tmp_path: Path, not_run: NotRun, only: str, message: str
) -> None:
    result = invoke("--only", only, "--out", str(tmp_path))
    assert result.exit_code == 2, result.output
    line = error_line(result.output)
    assert line.startswith("Error: Invalid value for '--only':")
    assert message in line and "known: broker," in line
    assert not_run.calls == []
    assert list(tmp_path.iterdir()) == []  # --out is not even touched


def test_only_strips_spaces_and_keeps_run_order(tmp_path: Path, not_run: NotRun) -> None:
    assert parse_only(" faults ,broker") == ["broker", "faults"]
    assert split_list(" a, b ") == ["a", "b"]
    not_run.allowed = True
    result = invoke("--only", " faults", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert not_run.calls == [(["faults"], tmp_path)]


# ------------------------------------------------------------ what a cut-short run keeps


def section(name: str) -> Section:
    return Section(name, f"Scenario {name}", f"{name} was measured", data={"figure": name})


def test_ctrl_c_keeps_the_scenarios_finished_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """runner.run: the second scenario is interrupted (after its own cleanup, which a
    ``finally`` runs as the KeyboardInterrupt goes through it)."""
    cleaned: list[str] = []

    def interrupted(ctx: BenchContext) -> Section:
        try:
            raise KeyboardInterrupt
        finally:
            cleaned.append("faults")

    def never(ctx: BenchContext) -> Section:
        raise AssertionError("a scenario after the interrupted one ran")

    monkeypatch.setattr(
        runner,
        "SCENARIOS",
        {
            "broker": Scenario(lambda ctx: 1, lambda ctx: section("broker")),
            "faults": Scenario(lambda ctx: 1, interrupted),
            "host": Scenario(lambda ctx: 1, never),
        },
    )
    done = runner.run(["broker", "faults", "host"], tmp_path, True, "test", None, False)
    assert done.interrupted == "faults" and cleaned == ["faults"]
    assert done.report == tmp_path / "report.md" and done.problem == ""
    assert [s.name for s in done.sections] == ["broker"]
    text = (tmp_path / "report.md").read_text()
    assert "- interrupted: by Ctrl-C during faults; finished: broker" in text
    assert "broker was measured" in text
    data = json.loads((tmp_path / "report.json").read_text())
    assert list(data["scenarios"]) == ["broker"]
    assert data["meta"]["interrupted"] == "by Ctrl-C during faults; finished: broker"


def test_the_cli_exits_130_on_ctrl_c_after_writing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cut(names: list[str], out: Path, *rest: Any, **kw: Any) -> Outcome:
        path = save(out, [section("broker")], {"interrupted": "by Ctrl-C during faults"})[0]
        return Outcome(path, [section("broker")], {}, "", "faults")

    monkeypatch.setattr(bench_cli, "run_bench", cut)
    result = invoke("--only", "broker,faults", "--out", str(tmp_path))
    assert result.exit_code == 130, result.output
    assert f"report: {tmp_path / 'report.md'}" in result.output
    assert "interrupted during faults" in result.output
    assert (tmp_path / "report.md").exists()
    assert not (tmp_path / outdir.LOCK_NAME).exists()


def test_a_report_that_cannot_go_into_out_goes_to_a_temporary_directory(
    tmp_path: Path,
) -> None:
    (tmp_path / "a-file").write_text("")
    out = tmp_path / "a-file" / "report"
    path, problem = save(out, [section("broker")], {"engine": "test"})
    assert path is not None and path.parent != out
    assert path.parent.name.startswith("edgenode-bench-")
    assert "broker was measured" in path.read_text()
    assert json.loads((path.parent / "report.json").read_text())["meta"] == {"engine": "test"}
    assert problem.startswith(f"could not write the report into {out} (")
    assert problem.endswith(f"wrote it into {path.parent} instead")


def test_a_report_that_can_be_written_nowhere_is_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("")
    nowhere = tmp_path / "a-file" / "x"
    monkeypatch.setattr(runner.tempfile, "mkdtemp", lambda prefix: str(nowhere))
    path, problem = save(nowhere, [section("broker")], {"engine": "test"})
    assert path is None
    assert "nor into a temporary directory" in problem

    def unwritten(names: list[str], out: Path, *rest: Any, **kw: Any) -> Outcome:
        return Outcome(None, [section("broker")], {"engine": "test"}, problem)

    monkeypatch.setattr(bench_cli, "run_bench", unwritten)
    result = invoke("--only", "broker", "--out", str(tmp_path / "out"))
    assert result.exit_code == 1, result.output
    assert "## Scenario broker" in result.output and "broker was measured" in result.output
    assert "the report above is its only copy" in result.output


# ------------------------------------------------------------------- faults: the docs


def test_bench_faults_help_says_the_counts_the_code_uses() -> None:
    script = REPO / "scripts" / "bench_faults.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())
    ctx = BenchContext(True, "test", None, NoProgress())
    deadlines, fault_count = faults.QUICK
    assert faults.steps(ctx) == 1 + 2 * deadlines + 2 * fault_count
    assert f"--quick {deadlines} deadline runs per kind" in text
    assert f"{fault_count} fault per signal" in text
    assert f"without it {faults.FULL.deadlines} deadline runs" in text


def test_the_report_says_the_default_heartbeats_meet_the_sigstop_goal() -> None:
    defaults = BrokerSettings()
    bound = faults.sigstop_bound_ms(defaults)
    assert bound == defaults.heartbeat_interval_ms * defaults.heartbeat_liveness == 1500
    assert bound <= faults.GOALS_MS["sigstop"]
    ctx = BenchContext(True, "test", None, NoProgress())
    kill = {"detected_ms": 30.0, "recovered_ms": 900.0, "lost": 0}
    stop = {"detected_ms": 1400.0, "recovered_ms": 2300.0, "lost": 0}
    report = faults.section(ctx, [(1.0, 15.0)], [(2.0, 18.0)], [kill], [stop], 0)
    note = faults.sigstop_note(defaults)
    assert note in report.text
    assert "(the defaults)" in note and "inside the 2000 ms goal" in note
    assert "missed" not in note
    assert report.data["sigstop_bound_ms"] == 1500


def test_the_report_says_when_heartbeat_settings_miss_the_sigstop_goal() -> None:
    """The former defaults, 1000 ms x 3: missed by design, and the settings the note
    names do meet the goal, and nothing looser would."""
    former = BrokerSettings(heartbeat_interval_ms=1000, heartbeat_liveness=3)
    note = faults.sigstop_note(former)
    assert "the detection bound is 3 s" in note and "missed by design" in note
    assert "(the defaults)" not in note
    interval = int(re.findall(r"heartbeat_interval_ms` <= (\d+)", note)[0])
    liveness = int(re.findall(r"heartbeat_liveness` <= (\d+)", note)[0])
    goal = faults.GOALS_MS["sigstop"]
    for field, value in (("heartbeat_interval_ms", interval), ("heartbeat_liveness", liveness)):
        settings = {"heartbeat_interval_ms": 1000, "heartbeat_liveness": 3, field: value}
        assert faults.sigstop_bound_ms(BrokerSettings(**settings)) <= goal
        settings[field] = value + 1
        assert faults.sigstop_bound_ms(BrokerSettings(**settings)) > goal
    met = faults.sigstop_note(BrokerSettings(heartbeat_interval_ms=interval))
    assert "inside the 2000 ms goal" in met and "missed" not in met


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("bench_throughput.py", ["--levels", "1,,4"], "--levels: an empty level in '1,,4'"),
        ("bench_throughput.py", ["--backends", "node,"], "--backends: an empty backend"),
        ("bench_overhead.py", ["--inflight", " , "], "--inflight: no level given"),
        ("bench_overhead.py", ["--stream", ""], "--stream: no level given"),
        ("bench_grammar.py", ["--cases", ""], "--cases: no case given"),
        ("bench_load.py", ["--estimates", "mean,,size"], "--estimates: an empty estimate"),
    ],
)
def test_the_bench_scripts_list_options_are_checked_alike(
    script: str, args: list[str], message: str
) -> None:
    """``split_list`` through argparse (``list_type``): refused before anything runs."""
    done = run_script(script, *args)
    assert done.returncode == 2, done.stderr
    assert f"error: argument {message}" in done.stderr


def run_script(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``python scripts/<script> args`` with this checkout on the path."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, str(REPO / "scripts" / script), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--tokens", "0"], "argument --tokens: 0 is not in 1..128"),
        (["--tokens", "-3"], "argument --tokens: -3 is not in 1..128"),
        (["--tokens", "5000"], "argument --tokens: 5000 is not in 1..128"),
        (["--threads", "0"], "argument --threads: 0 is not in 1..256"),
        (["--threads", "abc"], "argument --threads: invalid integer value: 'abc'"),
    ],
)
def test_batch_rounding_refuses_sizes_it_cannot_run_before_loading(
    args: list[str], message: str
) -> None:
    """A new user's --tokens 0 ended in a traceback, --tokens 5000 after 1m46s of
    work, and --threads 0 ran on llama-cpp-python's own count under another name."""
    done = run_script("batch_rounding.py", *args)
    assert done.returncode == 2, done.stderr
    assert f"error: {message}" in done.stderr


def test_bench_throughput_refuses_a_directory_for_its_report(tmp_path: Path) -> None:
    # Found only when the report was written, after a 25-minute run.
    done = run_script("bench_throughput.py", "--out", str(tmp_path))
    assert done.returncode == 2, done.stderr
    assert f"--out {tmp_path} is a directory: give the report's file name" in done.stderr


def load_script(name: str) -> Any:
    """``scripts/<name>.py`` as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_isolation_report_also_judges_against_the_quiet_idle_rounds() -> None:
    """A run passed the isolation test only because two of its eight idle rounds were
    noisy (one set the spread): the report now also leaves the noisiest out."""
    module = load_script("isolation_report")
    idle = [0.21, 0.51, 0.35, 0.23, 1.86, 1.21, 0.41, 0.90]
    assert module.quiet(idle) == [0.21, 0.51, 0.35, 0.23, 1.21, 0.41, 0.90]
    assert module.quiet([1.0, 1.0, 1.0]) == [1.0, 1.0]  # a tie: one of them left out
    assert module.quiet([0.5, 2.0]) == [0.5, 2.0]  # too few to call one noisy


def case(p99: list[float], missed: list[float]) -> dict[str, Any]:
    """A probe case's summary (``node.bench.probe.summarize``) with these rounds."""
    return {
        "p50_us": 90.0,
        "p99_us": 200.0,
        "resp_p50_us": 700.0,
        "resp_p99_us": 1000.0,
        "resp_p99_median_us": sorted(p99)[(len(p99) - 1) // 2],
        "missed_pct": round(sum(missed) / len(missed), 2),
        "core_busy": [0.5, 0.5],
        "other_cores": 0.1,
        "resp_p99_rounds_us": p99,
        "missed_rounds_pct": missed,
    }


def test_the_isolation_report_prints_the_quiet_idle_test(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The 2026-12-07 run's rounds: the default passed the first test by the median, and
    fails against the idle rounds but their noisiest."""
    module = load_script("isolation_report")
    idle = case(
        [872.2, 846.5, 837.4, 864.1, 1187.4, 1040.1, 886.6, 949.7],
        [0.21, 0.51, 0.35, 0.23, 1.86, 1.21, 0.41, 0.9],
    )
    busy = case(
        [1095.7, 1088.2, 962.5, 1200.5, 1654.1, 1177.5, 1591.8, 2557.9],
        [1.3, 1.17, 0.98, 1.18, 1.94, 1.52, 2.48, 2.92],
    )
    config = {
        "name": "unreserved",
        "workers_cpus": [],
        "placement": {"llm-0": []},
        "busy_coverage": 1.0,
        "tok_per_s": 47.1,
        "busy": busy,
        "errors": [],
        "error_count": 0,
    }
    args = argparse.Namespace(rounds=8, iterations=10000, probe_core=0, work=16470, duty=0.5)
    module.report_probe({"idle": idle, "configs": [config]}, args)
    out = capsys.readouterr().out
    assert "unreserved    resp p99 median 1177.5 µs within, rounds 4 of 8 inside" in out
    assert "without the noisiest idle round (at most 1040.1 µs, 1.21 %):" in out
    assert (
        "unreserved    resp p99 median above (1.13x the idle max), rounds 1 of 8 inside; "
        "missed above (1.40x the idle max), rounds 3 of 8 inside" in out
    )


def test_the_isolation_report_sets_each_node_against_the_busy_loop(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The control case (no model, the reserved core spinning) gets a row of its own,
    and each node's busy case is divided by it."""
    module = load_script("isolation_report")
    idle = case([900.0, 910.0, 920.0], [0.3, 0.4, 0.5])
    node = {
        "name": "reserved",
        "workers_cpus": "auto",
        "placement": {"llm-0": [1]},
        "busy_coverage": 1.0,
        "tok_per_s": 47.1,
        "busy": case([950.0, 960.0, 1000.0], [0.6, 0.9, 1.2]),
        "errors": [],
        "error_count": 0,
    }
    control = {
        "name": "busy loop",
        "workers_cpus": [1],
        "placement": {},
        "busy_coverage": None,
        "tok_per_s": None,
        "busy": case([940.0, 1000.0, 1010.0], [0.5, 1.0, 1.5]),
        "errors": [],
        "error_count": 0,
    }
    args = argparse.Namespace(rounds=3, iterations=10000, probe_core=0, work=16470, duty=0.5)
    module.report_probe({"idle": idle, "configs": [node], "control": control}, args)
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.startswith("busy loop only"))
    cells = row.split()
    assert cells[3:5] == ["[1]", "90.0"] and cells[-5] == cells[-1] == "-"  # busy, tok/s
    assert "  busy loop     resp p99 median 1000.0 µs above (1.09x the idle max)" in out
    assert "  reserved      resp p99 median 0.96x, missed 0.90x" in out


def test_the_isolation_control_spins_on_its_core_and_ends_with_the_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The control's load runs only during its probe, at the workers' nice level, on
    the reserved core alone, and is gone when the probe has ended."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    module = load_script("bench_isolation")
    allowed = sorted(os.sched_getaffinity(0))
    seen: list[tuple[list[int], int]] = []
    real_probe = module.probe

    def probe(core: int, iterations: int, work: int, pids: list[int]) -> dict[str, Any]:
        for child in psutil.Process().children(recursive=True):
            if "while True" in " ".join(child.cmdline()):
                seen.append((child.cpu_affinity(), child.nice()))
        return real_probe(core, iterations, work, pids)  # type: ignore[no-any-return]

    monkeypatch.setattr(module, "probe", probe)
    control = module.Control([allowed[-1]])
    args = argparse.Namespace(probe_core=allowed[0], iterations=20, work=10)
    control.busy_probe(args, [], last=True)
    assert seen == [([allowed[-1]], WorkersSection().nice)]
    assert not [c for c in psutil.Process().children(recursive=True) if c.status() != "zombie"]
    result = control.result()
    assert result["workers_cpus"] == [allowed[-1]] and result["tok_per_s"] is None
    assert len(result["busy"]["missed_rounds_pct"]) == 1


def test_bench_throughput_measures_the_nodes_default_layout_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It measured two one-slot workers, the node's layout before slots, long after.
    monkeypatch.syspath_prepend(str(REPO / "scripts"))  # its report module, beside it
    module = load_script("bench_throughput")
    assert module.parse_args([]).layout is None
    assert module.DEFAULT_LAYOUT == (WorkersSection().count, WorkersSection().slots) == (1, 4)


def test_the_throughput_report_of_node_layouts_alone_has_no_empty_ratio_table(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A new user's ``--backends node`` report had a ratio table with no baseline column."""
    monkeypatch.syspath_prepend(str(REPO / "scripts"))
    report = load_script("throughput_report")
    data = json.loads((REPO / "docs" / "bench" / "ab4-8-epyc-order.json").read_text())
    node_runs = [r for r in data["runs"] if r["backend"].startswith("node")]
    alone = report.markdown(report.summarize(node_runs, [4]), data["meta"], [4])
    assert "| node 1x4 |" in alone and "÷" not in alone
    both = report.markdown(report.summarize(data["runs"], [4]), data["meta"], [4])
    assert "| node 1x4 | 4 | 0.99 | 1.01 |" in both
