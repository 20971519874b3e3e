"""The text of ``edgenode report``: a migration-log summary
(``node.migration.report.summarize``) as an operator reads it, per mode its figures and the
verdict hint (``node.migration.report.verdict``)."""

from __future__ import annotations

from typing import Any

from node.migration.report import verdict


def format_report(summary: dict[str, Any]) -> str:
    """The operator's text: what was read, then per mode its figures and a verdict hint."""
    lines = _header(summary)
    for mode, section in summary.get("by_mode", {}).items():
        lines.append("")
        lines.extend(_mode_block(mode, section))
    return "\n".join(lines)


def _header(summary: dict[str, Any]) -> list[str]:
    files = summary["files"]
    lines = [f"migration log: {len(files)} file(s), {summary['records']} record(s)"]
    if summary["malformed"]:
        lines[0] += f", {summary['malformed']} malformed line(s) skipped"
    if summary["first_ts"]:
        lines.append(f"period: {summary['first_ts']} .. {summary['last_ts']}")
    for path in summary["missing"]:
        lines.append(f"not found: {path}")
    if not summary["records"]:
        lines.append("no records: is a migration mode set in the config, and has traffic come?")
    return lines


def _mode_block(mode: str, s: dict[str, Any]) -> list[str]:
    pairs = s["pairs"]
    total = sum(s["events"].values())
    lines = [f"{mode}: {_agreement_line(pairs) if pairs['compared'] else f'{total} record(s)'}"]
    lines.append("  events: " + ", ".join(f"{name} {n}" for name, n in s["events"].items()))
    top = ", ".join(f"{f} {n}" for f, n in pairs["top_disagreeing_fields"])
    if top:
        lines.append(f"  most disagreeing fields: {top}")
    lines.extend(f"  {line}" for line in _latency_lines(s["latency_ms"]))
    llm = s["llm"]
    if llm["attempts"]:
        lines.append(f"  model errors: {llm['errors']} of {llm['attempts']}")
    for name, label in (
        ("fallback", "fallbacks to rules"),
        ("copy_skipped", "copies skipped"),
        ("refused", "model requests the broker refused or the client cancelled"),
    ):
        if s[name]["total"]:
            lines.append(f"  {label}: {_reason_line(s[name])}")
    if s["memory_peak_bytes"] is not None:
        lines.append(f"  model memory peak: {_mib(s['memory_peak_bytes'])}")
    lines.append(f"  verdict: {verdict(mode, s)}")
    return lines


def _agreement_line(pairs: dict[str, Any]) -> str:
    text = (
        f"{pairs['agreement_pct']:.1f}% agreement over {pairs['compared']} pairs "
        f"({pairs['low_confidence']} low-confidence)"
    )
    if pairs["mean_ratio"] is not None:
        text += f", mean field agreement {pairs['mean_ratio']:.2f}"
    uncompared = pairs["count"] - pairs["compared"]
    if uncompared:
        text += f"; {uncompared} pair(s) not compared (an engine failed)"
    return text


def _latency_lines(latency: dict[str, Any]) -> list[str]:
    rows = [(name, stats) for name, stats in latency.items() if stats]
    if not rows:
        return []
    out = [f"{'latency ms':<12}{'n':>7}{'p50':>8}{'p90':>8}{'p99':>8}{'max':>8}"]
    for name, st in rows:
        cells = "".join(f"{round(st[k]):>8}" for k in ("p50", "p90", "p99", "max"))
        out.append(f"{name:<12}{st['count']:>7}{cells}")
    return out


def _reason_line(counts: dict[str, Any]) -> str:
    reasons = ", ".join(f"{r} {n}" for r, n in counts["by_reason"].items())
    return f"{counts['total']} ({reasons})"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"
