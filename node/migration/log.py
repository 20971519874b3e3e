"""The migration log: one JSON line per shadow/dual/degrade/full record, size-rotated.

The broker (sans-I/O) emits plain dict records; the node process hands them to
``MigrationLog.write``, which stamps them, enriches ``pair`` records and appends them to
``<run_dir>/logs/migration.jsonl``. ``edgenode report`` (``node.migration.report``) reads them back.

Record shapes (the broker's side; ``id`` is the client's request id):

* ``pair``: both engines ran one request (modes shadow, dual); the rules' answer was
  returned. ``rules`` = {status, text, latency_ms, confidence, rule}, ``llm`` = {status,
  text, latency_ms, ttft_ms, worker, code}.
* ``fallback``: degrade mode answered from the rules instead of the model (``reason``);
  ``hedge: "rules_won"`` when a rule matched while the model was late (the model's job
  was cancelled).
* ``copy_skipped``: the model got no copy (``reason``: ``no_credit``, shadow's model was busy;
  ``no_model_worker``; ``queue_full``; ``circuit_open``).
* ``llm``: a request answered by the model (latency_ms, ttft_ms, status);
  ``hedge: "model_kept"`` when the rules were asked at the latency budget but no rule
  matched, so the model's answer was awaited.

Added here: ``ts`` (ISO-8601 UTC wall time, ms) on every record; on ``pair`` records
``agreement`` (``fallback.compare.compare_outputs(rules.text, llm.text).to_dict()``, or None
unless both engines answered ok), ``low_confidence`` (the rules' confidence is below the
threshold) and ``llm.memory_peak_bytes`` (from the ``memory_peak`` callback).

Lines are ASCII JSON (``ensure_ascii``), so the rotation's character count is the byte count.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from datetime import datetime, timezone
from logging.handlers import RotatingFileHandler
from pathlib import Path
from types import TracebackType
from typing import Any, TypeGuard

from fallback.compare import compare_outputs

_log = logging.getLogger(__name__)

#: Worker id -> the worker's memory peak in bytes, or None when unknown.
MemoryPeak = Callable[[str], int | None]


def migration_log_path(run_dir: Path) -> Path:
    """Where the node writes the migration log: ``<run_dir>/logs/migration.jsonl``."""
    return run_dir / "logs" / "migration.jsonl"


class MigrationLog:
    """Append-only JSON Lines writer with size rotation (not thread-safe: one loop writes).

    Args:
        path: the live file; backups are ``path.1`` (newest) .. ``path.<backups>``.
        max_bytes: rotate before a line would make the live file reach this size (bytes);
            0 = never rotate. A single line larger than this still gets written, alone.
        backups: rotated files kept; 0 = never rotate (the stdlib's semantics).
        low_confidence: rules confidences below this (in [0, 1]) mark a pair
            ``low_confidence`` for offline review.
        memory_peak: worker id -> its memory peak (bytes) or None; None = not recorded.
        clock: wall time in seconds since the epoch (injectable for tests).

    Raises:
        ValueError: a negative size or backup count.
        OSError: the file cannot be opened for appending (at construction, not per line).
    """

    def __init__(
        self,
        path: Path,
        max_bytes: int,
        backups: int,
        low_confidence: float,
        memory_peak: MemoryPeak | None = None,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if max_bytes < 0 or backups < 0:
            raise ValueError(f"max_bytes and backups must be >= 0, got {max_bytes}, {backups}")
        self.path = path
        self.low_confidence = low_confidence
        self._memory_peak = memory_peak
        self._clock = clock
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = _JsonLinesHandler(path, max_bytes, backups)
        self._closed = False

    @property
    def dropped(self) -> int:
        """Records lost to write errors (disk full, ...): counted and warned once, not raised,
        so a full disk never stops the node from answering."""
        return self._handler.dropped

    def write(self, record: dict[str, Any]) -> None:
        """Stamp, enrich (``pair``) and append ``record`` as one line; ``record`` is not
        modified. Flushed to the OS per line, never fsync'ed (a power cut may lose the tail).

        Raises:
            ValueError: the log is closed.
        """
        if self._closed:
            # The stdlib handler would silently reopen the file: a late write is a bug.
            raise ValueError(f"migration log {self.path} is closed")
        line = json.dumps(self.enrich(record), separators=(",", ":"), default=str)
        # The handler is used directly, without a logger: no global logger registry entry per
        # instance, and no level, filter or logging.disable() anywhere can drop a record.
        self._handler.handle(logging.makeLogRecord({"msg": line, "levelno": logging.INFO}))

    def enrich(self, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` with ``ts`` first (unless it has one) and, for ``pair``, the review fields."""
        out = {"ts": _iso_utc(self._clock()), **record}
        if record.get("event") == "pair":
            self._enrich_pair(out)
        return out

    def _enrich_pair(self, out: dict[str, Any]) -> None:
        rules = _section(out.get("rules"))
        llm = dict(_section(out.get("llm")))  # a copy: the caller's dict stays untouched
        both_ok = rules.get("status") == "ok" and llm.get("status") == "ok"
        out["agreement"] = (
            compare_outputs(str(rules.get("text", "")), str(llm.get("text", ""))).to_dict()
            if both_ok
            else None
        )
        confidence = rules.get("confidence")
        out["low_confidence"] = _is_number(confidence) and confidence < self.low_confidence
        worker = llm.get("worker")
        llm["memory_peak_bytes"] = (
            self._memory_peak(worker)
            if self._memory_peak is not None and isinstance(worker, str)
            else None
        )
        out["llm"] = llm

    def close(self) -> None:
        """Flush and close the file (idempotent)."""
        if not self._closed:
            self._closed = True
            self._handler.close()

    def __enter__(self) -> MigrationLog:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class _JsonLinesHandler(RotatingFileHandler):
    """The stdlib's size rotation, with write errors counted instead of printed per line."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        super().__init__(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        self.dropped = 0
        # bpo-45401: never rotate anything but a regular file (a FIFO, /dev/null). The
        # stdlib asks with two stat calls per line; the answer cannot change for the
        # node's own path, and a line is written per request on the broker's loop.
        self._regular = not (path.exists() and not path.is_file())

    def shouldRollover(self, record: logging.LogRecord) -> bool:
        """The stdlib's test (the file's size + this line >= ``maxBytes``), without
        formatting the line twice or seeking: the file is only appended to."""
        if not self._regular or self.maxBytes <= 0:
            return False
        if self.stream is None:  # reopened lazily after a rotation
            self.stream = self._open()
        size = self.stream.tell()
        # Never rotate an empty file (gh-116263, fixed in 3.13): a line larger than max_bytes
        # would otherwise rotate on every write and push the real backups out with empty ones.
        if size == 0:
            return False
        return size + len(self.format(record)) + 1 >= self.maxBytes

    def handleError(self, record: logging.LogRecord) -> None:
        self.dropped += 1
        if self.dropped == 1:
            _log.warning(
                "migration log %s: cannot write, dropping records", self.baseFilename, exc_info=True
            )


def _iso_utc(seconds: float) -> str:
    """``2025-01-31T12:00:00.123Z``: ISO-8601, UTC, milliseconds."""
    stamp = datetime.fromtimestamp(seconds, tz=timezone.utc).isoformat(timespec="milliseconds")
    return stamp.replace("+00:00", "Z")


def _section(value: Any) -> dict[str, Any]:
    # A malformed record is still logged (as given) rather than breaking the node's loop.
    return value if isinstance(value, dict) else {}


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
