"""node.bench.stats: the one percentile (nearest rank), its summary, p99 and ratios."""

from __future__ import annotations

import pytest

from node.bench.stats import median, p99, percentile, percentiles, ratio


def test_percentiles_nearest_rank_on_1_to_100() -> None:
    assert percentiles(range(100, 0, -1)) == {
        "count": 100,
        "p50": 50,
        "p90": 90,
        "p99": 99,
        "max": 100,
    }


def test_percentiles_on_ten_and_one_and_none() -> None:
    assert percentiles([10, 20, 30, 40, 50, 60, 70, 80, 90, 100]) == {
        "count": 10,
        "p50": 50,
        "p90": 90,
        "p99": 100,
        "max": 100,
    }
    assert percentiles([7]) == {"count": 1, "p50": 7, "p90": 7, "p99": 7, "max": 7}
    assert percentiles([]) is None


def test_one_percentile_by_nearest_rank_at_any_p() -> None:
    six = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0]
    assert [percentile(six, p) for p in (0, 16.6, 16.7, 50, 90, 99, 100)] == [1, 1, 2, 3, 6, 6, 6]
    for bad in ([], [1.0]):
        with pytest.raises(ValueError):
            percentile(bad, 101 if bad else 50)


def test_percentile_takes_any_iterable_and_never_interpolates() -> None:
    # Nearest rank: p50 of an even count is the lower middle sample, not 2.5.
    assert percentile(iter([4, 1, 3, 2]), 50) == 2
    assert percentile((x / 10 for x in range(1, 11)), 95) == 1.0


def test_p99_rounds_and_is_none_when_empty() -> None:
    assert p99([1.234, 2.345, 3.456]) == 3.5
    assert p99([1.234], digits=2) == 1.23
    assert p99([]) is None


def test_ratio_of_measured_to_baseline() -> None:
    assert ratio(35.0, 50.0) == 0.7
    assert ratio(0.0, 4.0) == 0.0
    # No ratio to a missing baseline or one that did nothing.
    assert ratio(3.0, 0.0) is None
    assert ratio(None, 2.0) is None
    assert ratio(2.0, None) is None


def test_median_is_the_50th_percentile() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4, 1, 3, 2]) == 2  # the lower middle: an observed value
    with pytest.raises(ValueError):
        median([])
