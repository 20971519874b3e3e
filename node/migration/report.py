"""Summarize migration logs (``node.migration.log``) for ``edgenode report``.

``summarize`` reads each log with its rotated backups (oldest first) and returns plain data
(JSON-able); ``verdict`` says whether a mode's evidence supports the next migration stage
(``routing.mode``: shadow -> dual -> degrade -> full, each stage giving the model more of
the answers the rules gave);
``node.migration.report_view.format_report`` turns both into the text an operator reads.

Conventions:

* Latency percentiles are ``node.bench.stats.percentiles`` (nearest rank: the
  ``ceil(p/100 * n)``-th smallest sample): every reported value is an observed latency, in ms.
* Engine latencies count successful answers only (errors are counted apart, since a crash
  is fast and a timeout is the budget, neither is the engine's speed). The rules' latency
  comes from ``pair`` records; the model's from ``pair`` and ``llm`` records.
* Malformed lines (not JSON, not an object, no ``event``) are skipped and counted; a line
  cut short by a crash of the writer is one of them. Blank lines are ignored.
* A log rotating while it is read may have a file counted twice or missed: fine for a report.
"""

from __future__ import annotations

import glob
import itertools
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from broker.kinds import ROUTING_MODES, RoutingMode
from broker.rounding import percent
from node.bench.stats import percentiles

#: The verdict's policy: samples needed before advancing, and the bars to clear.
MIN_SAMPLES = 50
#: dual -> degrade: fields of the model's JSON must match the rules' this often (%).
MIN_AGREEMENT_PCT = 95.0
#: Model errors tolerated (% of the model's attempts) before any advance.
MAX_LLM_ERROR_PCT = 1.0
#: shadow -> dual: dual runs the model on every request; more skipped copies = no capacity (%).
MAX_SKIPPED_PCT = 10.0
#: degrade -> full: the rules may still answer this share of requests (%).
MAX_FALLBACK_PCT = 1.0

TOP_FIELDS = 5
#: The stage after each one but the last (``broker.kinds.ROUTING_MODES``' order).
_NEXT: dict[str, RoutingMode] = dict(itertools.pairwise(ROUTING_MODES))
_BACKUP = re.compile(r"\.(\d+)$")


def log_files(path: Path) -> list[Path]:
    """``path``'s existing rotated backups, oldest first (``path.N`` .. ``path.1``), then
    ``path`` itself if it exists."""
    backups: list[tuple[int, Path]] = []
    if path.parent.is_dir():
        for candidate in path.parent.glob(f"{glob.escape(path.name)}.*"):
            match = _BACKUP.fullmatch(candidate.name[len(path.name) :])
            if match and candidate.is_file():
                backups.append((int(match.group(1)), candidate))
    files = [p for _, p in sorted(backups, reverse=True)]
    return [*files, path] if path.is_file() else files


@dataclass
class _Tally:
    """Accumulates one scope (all records, or one mode)."""

    events: Counter[str] = field(default_factory=Counter)
    pairs: int = 0
    compared: int = 0
    agree: int = 0
    ratio_sum: float = 0.0
    low_confidence: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    disagree: Counter[str] = field(default_factory=Counter)
    rules_errors: int = 0
    llm_attempts: int = 0
    llm_errors: int = 0
    rules_ms: list[float] = field(default_factory=list)
    llm_ms: list[float] = field(default_factory=list)
    llm_ttft_ms: list[float] = field(default_factory=list)
    fallback_ms: list[float] = field(default_factory=list)
    fallback: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    memory_peak: int | None = None

    def add(self, rec: dict[str, Any]) -> None:
        event = str(rec["event"])
        self.events[event] += 1
        if event == "pair":
            self._pair(rec)
        elif event == "llm":
            self._llm(rec)
        elif event == "fallback":
            self.fallback[str(rec.get("reason"))] += 1
            _append_number(self.fallback_ms, rec.get("latency_ms"))
        elif event == "copy_skipped":
            self.skipped[str(rec.get("reason"))] += 1

    def _pair(self, rec: dict[str, Any]) -> None:
        self.pairs += 1
        self.low_confidence += rec.get("low_confidence") is True
        rules = _dict(rec.get("rules"))
        if rules.get("status") == "ok":
            _append_number(self.rules_ms, rules.get("latency_ms"))
        else:
            self.rules_errors += 1
        self._llm(_dict(rec.get("llm")))
        agreement = rec.get("agreement")
        if isinstance(agreement, dict):
            self._agreement(agreement)

    def _agreement(self, agreement: dict[str, Any]) -> None:
        self.compared += 1
        self.agree += agreement.get("agree") is True
        ratio = agreement.get("ratio")
        self.ratio_sum += float(ratio) if _is_number(ratio) else 0.0
        self.kinds[str(agreement.get("kind"))] += 1
        if agreement.get("agree") is not True:
            self.disagree.update(str(f) for f in agreement.get("disagree") or [])

    def _llm(self, llm: dict[str, Any]) -> None:
        if llm.get("status") != "ok" and not _model_failure(llm):
            self.refused[str(llm.get("reason") or llm.get("code"))] += 1
            return
        self.llm_attempts += 1
        if llm.get("status") == "ok":
            _append_number(self.llm_ms, llm.get("latency_ms"))
            _append_number(self.llm_ttft_ms, llm.get("ttft_ms"))
        else:
            self.llm_errors += 1
        peak = llm.get("memory_peak_bytes")
        if _is_number(peak) and (self.memory_peak is None or peak > self.memory_peak):
            self.memory_peak = int(peak)

    def result(self) -> dict[str, Any]:
        return {
            "events": dict(sorted(self.events.items())),
            "pairs": self._pairs_result(),
            "llm": {"attempts": self.llm_attempts, "errors": self.llm_errors},
            "latency_ms": {
                "rules": percentiles(self.rules_ms),
                "llm": percentiles(self.llm_ms),
                "llm_ttft": percentiles(self.llm_ttft_ms),
                "fallback": percentiles(self.fallback_ms),
            },
            "fallback": _reasons(self.fallback),
            "copy_skipped": _reasons(self.skipped),
            "refused": _reasons(self.refused),
            "memory_peak_bytes": self.memory_peak,
        }

    def _pairs_result(self) -> dict[str, Any]:
        return {
            "count": self.pairs,
            "compared": self.compared,
            "agree": self.agree,
            "agreement_pct": percent(self.agree, self.compared, 2),
            "mean_ratio": round(self.ratio_sum / self.compared, 4) if self.compared else None,
            "low_confidence": self.low_confidence,
            "rules_errors": self.rules_errors,
            "kinds": dict(sorted(self.kinds.items())),
            "top_disagreeing_fields": [[f, n] for f, n in _top(self.disagree)],
        }


def summarize(paths: list[Path]) -> dict[str, Any]:
    """Read every log in ``paths`` with its rotated backups and summarize them.

    Returns:
        ``files`` read, ``missing`` (given paths with no file at all), ``records``,
        ``malformed`` lines, ``first_ts``/``last_ts``, ``modes`` (records per mode), and for
        all records together and in ``by_mode[mode]`` each: ``events`` (counts), ``pairs``
        (count, compared, agree, agreement_pct, mean_ratio, low_confidence, rules_errors,
        kinds, top_disagreeing_fields as [field, count]), ``llm`` (attempts, errors),
        ``latency_ms`` (rules, llm, llm_ttft, fallback: count/p50/p90/p99/max or None),
        ``fallback`` and ``copy_skipped`` ({total, by_reason}), ``memory_peak_bytes`` (max).
    """
    files, missing = _expand(paths)
    overall = _Tally()
    by_mode: dict[str, _Tally] = {}
    malformed = 0
    stamps: list[str] = []
    for rec in _records(files):
        if rec is None:
            malformed += 1
            continue
        overall.add(rec)
        by_mode.setdefault(str(rec.get("mode")), _Tally()).add(rec)
        if isinstance(rec.get("ts"), str):
            stamps.append(rec["ts"])
    return {
        "files": [str(f) for f in files],
        "missing": [str(p) for p in missing],
        "records": sum(overall.events.values()),
        "malformed": malformed,
        "first_ts": min(stamps, default=None),  # ISO-8601 UTC sorts as text
        "last_ts": max(stamps, default=None),
        "modes": {m: sum(t.events.values()) for m, t in _in_mode_order(by_mode)},
        **overall.result(),
        "by_mode": {m: t.result() for m, t in _in_mode_order(by_mode)},
    }


def _expand(paths: list[Path]) -> tuple[list[Path], list[Path]]:
    files: list[Path] = []
    missing: list[Path] = []
    for path in paths:
        found = log_files(path)
        if not found:
            missing.append(path)
        # Given both "x" and "x.1", read x.1 once.
        files.extend(f for f in found if f not in files)
    return files, missing


def _records(files: list[Path]) -> Iterator[dict[str, Any] | None]:
    """Each line's record, or None for a malformed one."""
    for path in files:
        with path.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if line.strip():
                    yield _parse(line)


def _parse(line: str) -> dict[str, Any] | None:
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
        return None
    return rec


def _in_mode_order(by_mode: dict[str, _Tally]) -> list[tuple[str, _Tally]]:
    def key(item: tuple[str, _Tally]) -> tuple[int, str]:
        mode = item[0]
        order: tuple[str, ...] = ROUTING_MODES
        return (order.index(mode) if mode in order else len(order), mode)

    return sorted(by_mode.items(), key=key)


def _reasons(counts: Counter[str]) -> dict[str, Any]:
    return {"total": sum(counts.values()), "by_reason": dict(counts.most_common())}


def _top(counts: Counter[str]) -> list[tuple[str, int]]:
    # Ties broken by name so the report is stable from run to run.
    return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:TOP_FIELDS]


def _model_failure(llm: dict[str, Any]) -> bool:
    """Whether a model request's error is the model pool's, as the circuit breaker
    judges it (``broker.routing``): an engine error (500), a lost worker, a
    deadline reached on a worker. The broker's own refusals (an evicted or
    shed queued request, shutdown, a deadline reached in the queue) and the
    client's cancels say nothing of the model: a flood counted 160 of 352 as
    "model errors". Records from before ``dispatched`` was logged count as before."""
    if "dispatched" not in llm:
        return True
    code = llm.get("code")
    return (
        code == 500
        or llm.get("reason") == "worker_lost"
        or (code == 504 and llm.get("dispatched") is True)
    )


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _append_number(values: list[float], value: object) -> None:
    if _is_number(value):
        values.append(value)


def verdict(mode: str, s: dict[str, Any]) -> str:
    """A one-line hint whether ``mode``'s evidence supports the next stage (policy: the
    module's MIN_/MAX_ constants). A hint: the operator decides."""
    llm = s["llm"]
    error_pct = percent(llm["errors"], llm["attempts"], 2) or 0.0
    if mode == "full":
        if error_pct > MAX_LLM_ERROR_PCT:
            return f"model errors {error_pct:.1f}% > {MAX_LLM_ERROR_PCT:g}%: consider degrade"
        return "model-only serving looks healthy"
    if mode not in _NEXT:
        return "unknown mode: no verdict"
    hold = _hold_reason(mode, s, error_pct)
    return f"hold: {hold}" if hold else f"ready for {_NEXT[mode]}"


def _hold_reason(mode: str, s: dict[str, Any], error_pct: float) -> str | None:
    samples = s["llm"]["attempts"] + s["fallback"]["total"]
    if samples < MIN_SAMPLES:
        return f"only {samples} model samples, need {MIN_SAMPLES}"
    if error_pct > MAX_LLM_ERROR_PCT:
        return f"model errors {error_pct:.1f}% > {MAX_LLM_ERROR_PCT:g}%"
    if mode == "shadow":
        return _shadow_hold(s)
    if mode == "dual":
        return _dual_hold(s)
    return _degrade_hold(s, samples)


def _shadow_hold(s: dict[str, Any]) -> str | None:
    skipped = s["copy_skipped"]["total"]
    skipped_pct = percent(skipped, skipped + s["pairs"]["count"], 2) or 0.0
    if skipped_pct > MAX_SKIPPED_PCT:
        return (
            f"{skipped_pct:.1f}% of copies skipped (model busy) > {MAX_SKIPPED_PCT:g}%: "
            "dual would run it on every request"
        )
    return None


def _dual_hold(s: dict[str, Any]) -> str | None:
    pairs = s["pairs"]
    if pairs["compared"] < MIN_SAMPLES:
        return f"only {pairs['compared']} compared pairs, need {MIN_SAMPLES}"
    if pairs["agreement_pct"] < MIN_AGREEMENT_PCT:
        fields = ", ".join(f for f, _ in pairs["top_disagreeing_fields"]) or "text answers"
        return (
            f"agreement {pairs['agreement_pct']:.1f}% < {MIN_AGREEMENT_PCT:g}%; "
            f"review disagreements ({fields})"
        )
    return None


def _degrade_hold(s: dict[str, Any], samples: int) -> str | None:
    fallbacks = s["fallback"]
    fallback_pct = percent(fallbacks["total"], samples, 2) or 0.0
    if fallback_pct > MAX_FALLBACK_PCT:
        top = next(iter(fallbacks["by_reason"]), "?")
        return (
            f"{fallback_pct:.1f}% of requests fell back to the rules > {MAX_FALLBACK_PCT:g}% "
            f"(mostly {top})"
        )
    return None
