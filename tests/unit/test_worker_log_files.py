"""Worker logs are rotated by size when a worker (re)spawns: ``open_worker_log``."""

from __future__ import annotations

from pathlib import Path

from node.supervisor import WORKER_LOG_BACKUPS, open_worker_log


def write(path: Path, data: bytes) -> None:
    with open(path, "ab") as out:
        out.write(data)


def test_a_log_within_the_limit_is_appended_to(tmp_path: Path) -> None:
    log = tmp_path / "llm-0.log"
    write(log, b"a" * 100)
    with open_worker_log(log, max_bytes=100) as out:  # at the limit: not over it
        out.write(b"b")
    assert log.read_bytes() == b"a" * 100 + b"b"
    assert not (tmp_path / "llm-0.log.1").exists()


def test_a_log_over_the_limit_moves_to_dot_1(tmp_path: Path) -> None:
    log = tmp_path / "llm-0.log"
    write(log, b"a" * 101)
    with open_worker_log(log, max_bytes=100) as out:
        out.write(b"fresh")
    assert log.read_bytes() == b"fresh"
    assert (tmp_path / "llm-0.log.1").read_bytes() == b"a" * 101


def test_only_the_newest_backups_are_kept(tmp_path: Path) -> None:
    log = tmp_path / "llm-0.log"
    for run in b"abcd":
        with open_worker_log(log, max_bytes=10) as out:
            out.write(bytes([run]) * 20)
    assert WORKER_LOG_BACKUPS == 2
    assert log.read_bytes() == b"d" * 20
    assert (tmp_path / "llm-0.log.1").read_bytes() == b"c" * 20
    assert (tmp_path / "llm-0.log.2").read_bytes() == b"b" * 20
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llm-0.log", "llm-0.log.1", "llm-0.log.2"]


def test_zero_never_rotates_and_a_missing_log_is_created(tmp_path: Path) -> None:
    log = tmp_path / "rules-0.log"
    for _ in range(3):
        with open_worker_log(log, max_bytes=0) as out:
            out.write(b"x" * 50)
    assert log.stat().st_size == 150
    assert [p.name for p in tmp_path.iterdir()] == ["rules-0.log"]
