"""node.migration.report (summarize), its view (format_report) and
``edgenode report`` via CliRunner."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from node.cli.report import report
from node.migration.log import MigrationLog
from node.migration.report import log_files, summarize, verdict
from node.migration.report_view import format_report

AGREE = '{"intent":"lights_on","room":"Kitchen"}'
OFF = '{"intent":"lights_off","room":"kitchen"}'
ELSEWHERE = '{"intent":"lights_on","room":"hall"}'


def pair(
    i: int,
    llm_text: str = AGREE,
    *,
    mode: str = "dual",
    confidence: float | None = 0.9,
    rules_ms: int = 2,
    llm_ms: int = 200,
    llm_status: str = "ok",
) -> dict[str, Any]:
    return {
        "event": "pair",
        "mode": mode,
        "id": i,
        "prompt": "turn on the kitchen lights",
        "schema": True,
        "rules": {
            "status": "ok",
            "text": '{"intent":"lights_on","room":"kitchen"}',
            "latency_ms": rules_ms,
            "confidence": confidence,
            "rule": "lights_on",
        },
        "llm": {
            "status": llm_status,
            "text": llm_text,
            "latency_ms": llm_ms,
            "ttft_ms": llm_ms // 4,
            "worker": "llm-0",
            "code": None if llm_status == "ok" else 500,
        },
    }


def ev(event: str, mode: str, **fields: Any) -> dict[str, Any]:
    """A non-pair record (fallback, copy_skipped, llm)."""
    return {"event": event, "mode": mode, "id": "x", **fields}


def write_log(path: Path, records: list[dict[str, Any]], peak: int | None = None) -> None:
    with MigrationLog(path, 1 << 20, 3, 0.5, memory_peak=lambda w: peak) as log:
        for rec in records:
            log.write(rec)


def dual_50(path: Path) -> None:
    """50 dual pairs: 48 agree; 1 disagrees on intent, 1 on room; 3 low-confidence."""
    records = [pair(i, confidence=0.3 if i < 3 else 0.9, llm_ms=100 + i) for i in range(48)]
    records += [pair(48, OFF), pair(49, ELSEWHERE)]
    write_log(path, records, peak=250 * 2**20)


# -- summarize --------------------------------------------------------------------------------


def test_dual_agreement_fields_and_latencies(tmp_path: Path) -> None:
    path = tmp_path / "migration.jsonl"
    dual_50(path)
    s = summarize([path])
    assert s["events"] == {"pair": 50}
    assert s["modes"] == {"dual": 50}
    pairs = s["pairs"]
    assert pairs["count"] == pairs["compared"] == 50
    assert pairs["agree"] == 48
    assert pairs["agreement_pct"] == 96.0
    assert pairs["mean_ratio"] == pytest.approx((48 + 0.5 + 0.5) / 50)
    assert pairs["low_confidence"] == 3
    assert pairs["kinds"] == {"json": 50}
    assert pairs["top_disagreeing_fields"] == [["intent", 1], ["room", 1]]
    assert s["latency_ms"]["rules"] == {"count": 50, "p50": 2, "p90": 2, "p99": 2, "max": 2}
    assert s["latency_ms"]["llm"]["max"] == 200
    assert s["memory_peak_bytes"] == 250 * 2**20
    assert s["by_mode"]["dual"]["pairs"] == pairs


def test_llm_latency_from_pairs_and_llm_events_and_reasons(tmp_path: Path) -> None:
    path = tmp_path / "migration.jsonl"
    records: list[dict[str, Any]] = [
        pair(1, mode="shadow", llm_ms=10),
        pair(2, mode="shadow", llm_ms=5000, llm_status="error"),
        ev("copy_skipped", "shadow", reason="no_credit"),
        ev("copy_skipped", "dual", reason="queue_full"),
        ev("llm", "degrade", latency_ms=20, ttft_ms=8, status="ok"),
        ev("llm", "full", latency_ms=30, ttft_ms=None, status="ok"),
        ev("llm", "full", latency_ms=9, status="error"),
        ev("fallback", "degrade", reason="circuit_open", latency_ms=3),
        ev("fallback", "degrade", reason="circuit_open", latency_ms=4),
        ev("fallback", "degrade", reason="latency_budget", latency_ms=210),
    ]
    write_log(path, records)
    s = summarize([path])
    assert s["events"] == {"copy_skipped": 2, "fallback": 3, "llm": 3, "pair": 2}
    assert list(s["modes"]) == ["shadow", "dual", "degrade", "full"]
    assert s["modes"] == {"shadow": 3, "dual": 1, "degrade": 4, "full": 2}
    # Successful model answers only: 10 (pair), 20 (degrade), 30 (full).
    assert s["latency_ms"]["llm"] == {"count": 3, "p50": 20, "p90": 30, "p99": 30, "max": 30}
    assert s["latency_ms"]["llm_ttft"]["count"] == 2
    assert s["latency_ms"]["fallback"]["max"] == 210
    assert s["llm"] == {"attempts": 5, "errors": 2}
    assert s["pairs"]["compared"] == 1  # the failed model answer is not compared
    assert s["fallback"] == {"total": 3, "by_reason": {"circuit_open": 2, "latency_budget": 1}}
    assert s["copy_skipped"]["by_reason"] == {"no_credit": 1, "queue_full": 1}
    assert s["by_mode"]["degrade"]["fallback"]["total"] == 3
    assert s["by_mode"]["shadow"]["copy_skipped"]["by_reason"] == {"no_credit": 1}


def test_only_the_models_own_failures_count_as_model_errors(tmp_path: Path) -> None:
    """Break-it finding: after a flood the report said "model errors 160 of 352"
    (hold), counting the broker's own refusals of queued requests."""
    path = tmp_path / "migration.jsonl"

    def llm(code: int | None, reason: str | None = None, dispatched: bool = True) -> dict[str, Any]:
        status = "ok" if code is None else "error"
        return ev("llm", "full", status=status, code=code, reason=reason, dispatched=dispatched)

    write_log(
        path,
        [
            llm(None),
            llm(500),  # the engine failed
            llm(503, "worker_lost"),  # the worker died
            llm(504),  # a deadline reached on a worker: slow
            llm(504, dispatched=False),  # expired in the queue: the broker's backlog
            llm(503, "queue_full", dispatched=False),  # evicted by a critical request
            llm(503, "shutdown", dispatched=False),
            llm(499, dispatched=True),  # the client cancelled
        ],
    )
    s = summarize([path])
    assert s["llm"] == {"attempts": 4, "errors": 3}
    assert s["refused"]["by_reason"] == {"504": 1, "queue_full": 1, "shutdown": 1, "499": 1}
    text = format_report(s)
    assert "model errors: 3 of 4" in text
    assert "model requests the broker refused or the client cancelled: 4" in text


def test_malformed_lines_are_counted_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "migration.jsonl"
    write_log(path, [pair(1)])
    with path.open("a") as f:
        f.write("not json\n[1, 2]\n{}\n\n" + '{"event": 5}\n')
        f.write('{"ts":"x","event":"pair","mode":"dual","rules":{"sta')  # writer cut short
    with path.open("ab") as f:
        f.write(b"\n\xff\xfe{\n")
    write_log(path, [pair(2)])
    s = summarize([path])
    assert s["malformed"] == 6
    assert s["records"] == 2
    assert s["pairs"]["agree"] == 2


def test_backups_read_oldest_first_and_missing_listed(tmp_path: Path) -> None:
    live = tmp_path / "m.jsonl"
    for name, i in (("m.jsonl.10", 0), ("m.jsonl.9", 1), ("m.jsonl.1", 2), ("m.jsonl", 3)):
        write_log(tmp_path / name, [pair(i)])
    (tmp_path / "m.jsonl.1.gz").write_text("ignored")
    (tmp_path / "m.jsonl.old").write_text("ignored")
    assert [f.name for f in log_files(live)] == ["m.jsonl.10", "m.jsonl.9", "m.jsonl.1", "m.jsonl"]
    absent = tmp_path / "nope.jsonl"
    s = summarize([live, tmp_path / "m.jsonl.1", absent])  # m.jsonl.1 is read once
    assert s["records"] == 4
    assert s["missing"] == [str(absent)]
    assert s["first_ts"] is not None and s["first_ts"] <= s["last_ts"]


# -- format_report and verdicts ---------------------------------------------------------------


def test_text_report_for_dual(tmp_path: Path) -> None:
    path = tmp_path / "migration.jsonl"
    dual_50(path)
    text = format_report(summarize([path]))
    assert "dual: 96.0% agreement over 50 pairs (3 low-confidence)" in text
    assert "most disagreeing fields: intent 1, room 1" in text
    assert "model memory peak: 250.0 MiB" in text
    assert "verdict: ready for degrade" in text


def test_verdicts_hold_with_reasons(tmp_path: Path) -> None:
    path = tmp_path / "migration.jsonl"
    records = [pair(i, OFF if i % 5 == 0 else AGREE) for i in range(60)]
    records += [pair(100 + i, mode="shadow") for i in range(10)]
    records += [ev("llm", "degrade", latency_ms=50, status="ok") for _ in range(90)]
    records += [ev("fallback", "degrade", reason="memory_pressure", latency_ms=2)] * 10
    records += [ev("llm", "full", latency_ms=50, status="error")] * 2
    write_log(path, records)
    s = summarize([path])
    assert verdict("dual", s["by_mode"]["dual"]).startswith(
        "hold: agreement 80.0% < 95%; review disagreements (intent)"
    )
    assert verdict("shadow", s["by_mode"]["shadow"]) == "hold: only 10 model samples, need 50"
    assert verdict("degrade", s["by_mode"]["degrade"]) == (
        "hold: 10.0% of requests fell back to the rules > 1% (mostly memory_pressure)"
    )
    assert verdict("full", s["by_mode"]["full"]).startswith("model errors 100.0%")
    text = format_report(s)
    for mode in ("shadow", "dual", "degrade", "full"):
        assert f"\n{mode}: " in text


def test_shadow_holds_when_the_model_was_busy(tmp_path: Path) -> None:
    path = tmp_path / "migration.jsonl"
    records = [pair(i, mode="shadow") for i in range(60)]
    records += [ev("copy_skipped", "shadow", reason="no_credit")] * 20
    write_log(path, records)
    v = verdict("shadow", summarize([path])["by_mode"]["shadow"])
    assert v.startswith("hold: 25.0% of copies skipped (model busy)")


def test_empty_log_reports_no_records(tmp_path: Path) -> None:
    path = tmp_path / "migration.jsonl"
    path.touch()
    text = format_report(summarize([path]))
    assert "1 file(s), 0 record(s)" in text
    assert "no records" in text


# -- CLI --------------------------------------------------------------------------------------


def test_cli_text_and_json(tmp_path: Path) -> None:
    path = tmp_path / "migration.jsonl"
    dual_50(path)
    result = CliRunner().invoke(report, ["--log", str(path)])
    assert result.exit_code == 0, result.output
    assert "dual: 96.0% agreement over 50 pairs (3 low-confidence)" in result.stdout
    result = CliRunner().invoke(report, ["--log", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["pairs"]["agreement_pct"] == 96.0


def test_cli_repeated_log_options(tmp_path: Path) -> None:
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_log(a, [pair(1)])
    write_log(b, [pair(2), pair(3)])
    result = CliRunner().invoke(report, ["--log", str(a), "--log", str(b), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["records"] == 3


def test_cli_missing_log_exits_1(tmp_path: Path) -> None:
    result = CliRunner().invoke(report, ["--log", str(tmp_path / "absent.jsonl")])
    assert result.exit_code == 1
    assert "no migration log at" in result.stderr


def test_cli_default_log_in_the_run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGENODE_RUN_DIR", str(tmp_path))
    monkeypatch.delenv("EDGENODE_CONFIG", raising=False)
    write_log(tmp_path / "logs" / "migration.jsonl", [pair(1)])
    result = CliRunner().invoke(report, ["--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["files"] == [str(tmp_path / "logs" / "migration.jsonl")]
