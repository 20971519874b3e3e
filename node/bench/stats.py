"""The statistics of every benchmark and report: one percentile, its summary, and ratios.

The percentile is the nearest-rank one (the ``ceil(p/100 x n)``-th smallest sample; Hyndman
and Fan's definition 1): every figure reported is a value that was observed, never an
interpolation between two, and p50 of an even count is the lower middle sample.
"""

from __future__ import annotations

from collections.abc import Iterable

#: The percentiles of ``percentiles``.
PERCENTILES = (50, 90, 99)


def percentile(values: Iterable[float], p: float) -> float:
    """The ``p``-th percentile (0..100) of ``values`` by nearest rank: the
    ``ceil(p/100 x n)``-th smallest (at least the first). The one percentile of
    the node's reports, of ``edgenode bench`` and of every script in ``scripts/``.

    Raises:
        ValueError: ``values`` is empty, or ``p`` is outside 0..100.
    """
    ordered = sorted(values)
    if not ordered or not 0 <= p <= 100:
        raise ValueError(f"percentile {p} of {len(ordered)} values")
    rank = -(-p * len(ordered) // 100)  # ceil(p x n / 100): exact for integer p
    return ordered[max(int(rank), 1) - 1]


def median(values: Iterable[float]) -> float:
    """The 50th ``percentile`` (nearest rank: of an even count, the lower middle sample).

    Raises:
        ValueError: ``values`` is empty.
    """
    return percentile(values, 50)


def percentiles(values: Iterable[float]) -> dict[str, float] | None:
    """``{"count", "p50", "p90", "p99", "max"}`` of ``values`` (``percentile``), None if empty."""
    ordered = sorted(values)
    if not ordered:
        return None
    out: dict[str, float] = {"count": len(ordered)}
    for p in PERCENTILES:
        out[f"p{p}"] = percentile(ordered, p)
    out["max"] = ordered[-1]
    return out


def p99(values: Iterable[float], digits: int = 1) -> float | None:
    """The 99th percentile rounded to ``digits``; None if ``values`` is empty."""
    ordered = list(values)
    return round(percentile(ordered, 99), digits) if ordered else None


def ratio(measured: float | None, baseline: float | None) -> float | None:
    """``measured / baseline``, the form every bench figure is compared in; None when
    either is missing or the baseline is 0 (no ratio to a baseline that did nothing)."""
    if measured is None or baseline is None or baseline == 0:
        return None
    return measured / baseline
