"""MigrationLog: stamping, pair enrichment (agreement, low confidence, memory peak), rotation."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from node.migration.log import MigrationLog, migration_log_path
from node.migration.report import log_files, summarize

RULES_KITCHEN = '{"intent":"lights_on","room":"kitchen"}'


def pair(llm_text: str, **over: Any) -> dict[str, Any]:
    """A dual-mode pair record as the broker emits it."""
    rec: dict[str, Any] = {
        "event": "pair",
        "mode": "dual",
        "id": "r1",
        "prompt": "turn on the kitchen lights",
        "schema": True,
        "rules": {
            "status": "ok",
            "text": RULES_KITCHEN,
            "latency_ms": 2,
            "confidence": 0.9,
            "rule": "lights_on",
        },
        "llm": {
            "status": "ok",
            "text": llm_text,
            "latency_ms": 180,
            "ttft_ms": 60,
            "worker": "llm-0",
            "code": None,
        },
    }
    rec.update(over)
    return rec


def lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def open_log(tmp_path: Path, **kw: Any) -> MigrationLog:
    args: dict[str, Any] = {"max_bytes": 1 << 20, "backups": 3, "low_confidence": 0.5}
    args.update(kw)
    return MigrationLog(tmp_path / "logs" / "migration.jsonl", **args)


def test_default_path_is_in_the_run_dirs_logs() -> None:
    assert migration_log_path(Path("/run/x")) == Path("/run/x/logs/migration.jsonl")


def test_json_intents_agree_after_normalisation(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.write(pair('{"intent":"lights_on","room":"Kitchen"}'))
    (rec,) = lines(log.path)
    assert rec["agreement"] == {
        "kind": "json",
        "agree": True,
        "ratio": 1.0,
        "fields": ["intent", "room"],
        "disagree": [],
    }
    assert rec["low_confidence"] is False


def test_json_intents_disagree_on_intent(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.write(pair('```json\n{"intent":"lights_off","room":"kitchen"}\n```'))
    (rec,) = lines(log.path)
    assert rec["agreement"]["agree"] is False
    assert rec["agreement"]["disagree"] == ["intent"]
    assert rec["agreement"]["ratio"] == 0.5


def test_no_agreement_unless_both_engines_answered_ok(tmp_path: Path) -> None:
    failed = pair("", llm={"status": "error", "text": "", "latency_ms": 5000, "code": 504})
    with open_log(tmp_path) as log:
        log.write(failed)
    (rec,) = lines(log.path)
    assert rec["agreement"] is None
    assert rec["llm"]["code"] == 504


@pytest.mark.parametrize(
    ("confidence", "low"), [(0.49, True), (0.5, False), (0.0, True), (None, False)]
)
def test_low_confidence_is_strictly_below_the_threshold(
    tmp_path: Path, confidence: float | None, low: bool
) -> None:
    rec = pair(RULES_KITCHEN)
    rec["rules"]["confidence"] = confidence
    with open_log(tmp_path, low_confidence=0.5) as log:
        log.write(rec)
    assert lines(log.path)[0]["low_confidence"] is low


def test_memory_peak_from_the_callback_by_worker_id(tmp_path: Path) -> None:
    asked: list[str] = []

    def peak(worker: str) -> int | None:
        asked.append(worker)
        return 300_000_000

    no_worker = pair(RULES_KITCHEN)
    no_worker["llm"]["worker"] = None
    with open_log(tmp_path, memory_peak=peak) as log:
        log.write(pair(RULES_KITCHEN))
        log.write(no_worker)
    first, second = lines(log.path)
    assert asked == ["llm-0"]
    assert first["llm"]["memory_peak_bytes"] == 300_000_000
    assert second["llm"]["memory_peak_bytes"] is None


def test_memory_peak_none_without_a_callback(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.write(pair(RULES_KITCHEN))
    assert lines(log.path)[0]["llm"]["memory_peak_bytes"] is None


def test_timestamp_is_iso_utc_with_ms_and_first(tmp_path: Path) -> None:
    with open_log(tmp_path, clock=lambda: 1_700_000_000.1234) as log:
        log.write({"event": "copy_skipped", "mode": "shadow", "id": 7, "reason": "no_credit"})
    text = log.path.read_text()
    assert text == (
        '{"ts":"2023-11-14T22:13:20.123Z","event":"copy_skipped","mode":"shadow",'
        '"id":7,"reason":"no_credit"}\n'
    )


def test_real_clock_stamp_shape(tmp_path: Path) -> None:
    with open_log(tmp_path) as log:
        log.write({"event": "llm", "mode": "full", "id": 1, "latency_ms": 9, "status": "ok"})
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", lines(log.path)[0]["ts"])


def test_callers_record_is_not_modified(tmp_path: Path) -> None:
    rec = pair(RULES_KITCHEN)
    before = json.dumps(rec, sort_keys=True)
    with open_log(tmp_path, memory_peak=lambda w: 1) as log:
        log.write(rec)
    assert json.dumps(rec, sort_keys=True) == before


def test_non_ascii_is_escaped_and_round_trips(tmp_path: Path) -> None:
    rec = pair('{"intent":"set_temperature","value":"21 °C"}', prompt="Wärmer, bitte: 21 °C")
    with open_log(tmp_path) as log:
        log.write(rec)
    raw = log.path.read_bytes()
    assert raw.isascii()  # so the rotation's character count is the byte count
    assert lines(log.path)[0]["prompt"] == "Wärmer, bitte: 21 °C"


def test_rotation_keeps_backups_under_the_size(tmp_path: Path) -> None:
    max_bytes = 2000
    with open_log(tmp_path, max_bytes=max_bytes, backups=2) as log:
        for i in range(60):
            log.write(pair(RULES_KITCHEN, id=i))
    files = log_files(log.path)
    assert [f.name for f in files] == ["migration.jsonl.2", "migration.jsonl.1", "migration.jsonl"]
    assert not (log.path.parent / "migration.jsonl.3").exists()
    assert all(0 < f.stat().st_size < max_bytes for f in files)
    ids = [rec["id"] for f in files for rec in lines(f)]
    # The newest records survive, oldest first across the files, none duplicated.
    assert ids == list(range(60 - len(ids), 60))
    assert len(ids) > len(lines(log.path))


def test_report_reads_across_rotated_files(tmp_path: Path) -> None:
    with open_log(tmp_path, max_bytes=2000, backups=20) as log:
        for i in range(20):
            log.write(pair(RULES_KITCHEN, id=i))
    assert len(log_files(log.path)) > 2
    summary = summarize([log.path])
    assert summary["events"] == {"pair": 20}
    assert summary["pairs"]["agreement_pct"] == 100.0
    assert summary["files"] == [str(f) for f in log_files(log.path)]


def test_a_record_larger_than_max_bytes_does_not_flush_out_backups(tmp_path: Path) -> None:
    with open_log(tmp_path, max_bytes=300, backups=2) as log:
        log.write({"event": "llm", "mode": "full", "id": "small", "status": "ok"})
        for i in range(3):
            log.write(pair(RULES_KITCHEN, id=i))  # each > 300 bytes
    names = {f.name: [r["id"] for r in lines(f)] for f in log_files(log.path)}
    assert names == {"migration.jsonl.2": [0], "migration.jsonl.1": [1], "migration.jsonl": [2]}


def test_no_fsync_per_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_fsync(fd: int) -> None:
        raise AssertionError("fsync called")

    monkeypatch.setattr(os, "fsync", no_fsync)
    with open_log(tmp_path) as log:
        for i in range(5):
            log.write(pair(RULES_KITCHEN, id=i))
        # Flushed to the OS per line: a reader sees every record before close.
        assert len(lines(log.path)) == 5


def test_write_errors_are_counted_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = open_log(tmp_path)

    def full(_: str) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(log._handler.stream, "write", full)
    log.write(pair(RULES_KITCHEN, id=1))
    log.write(pair(RULES_KITCHEN, id=2))
    monkeypatch.undo()
    log.write(pair(RULES_KITCHEN, id=3))
    log.close()
    assert log.dropped == 2
    assert [r["id"] for r in lines(log.path)] == [3]
    assert sum("cannot write" in r.getMessage() for r in caplog.records) == 1


def test_close_is_idempotent_and_later_writes_raise(tmp_path: Path) -> None:
    log = open_log(tmp_path)
    log.close()
    log.close()
    with pytest.raises(ValueError, match="closed"):
        log.write(pair(RULES_KITCHEN))


def test_negative_sizes_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="backups"):
        open_log(tmp_path, backups=-1)
