"""Rounding the broker's and the node's reports share (a leaf: imports nothing)."""

from __future__ import annotations


def ms(seconds: float) -> int:
    """Seconds as whole milliseconds, never negative."""
    return max(0, round(seconds * 1000))


def percent(part: int, whole: int, digits: int) -> float | None:
    """``part`` of ``whole`` in percent, rounded to ``digits`` decimals; None when
    ``whole`` is 0 (no share to speak of)."""
    return round(100 * part / whole, digits) if whole else None
