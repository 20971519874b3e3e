"""``node.llama.slots.batch_order`` against a model of llama.cpp's ``split_equal``.

The model follows src/llama-batch.cpp (``llama_batch_allocr::split_equal`` with
``sequential = true`` and ``n_keep_tail = 0``, as the per-sequence KV cache calls
it): a ubatch's sequence set starts at the first unused row and takes each later
unused row whose sequence is the last one taken + 1; then it takes one token of
every sequence in the set at a time, while each has one left, up to ``n_ubatch``.
"""

from __future__ import annotations

import itertools

import pytest

from node.llama.slots import batch_order
from node.llama.ubatch import DecodePlan

#: One batch row: its sequence id.
Rows = list[int]


def split_equal(rows: Rows, n_ubatch: int = 512) -> list[list[int]]:
    """The ubatches llama.cpp makes of ``rows`` (row indices, per ubatch)."""
    used = [False] * len(rows)
    ubatches: list[list[int]] = []
    while not all(used):
        sets: list[int] = []
        for i, seq in enumerate(rows):
            if used[i] or seq in sets:
                continue
            if not sets or seq == sets[-1] + 1:
                sets.append(seq)
        left = {s: [i for i, q in enumerate(rows) if q == s and not used[i]] for s in sets}
        taken: list[int] = []
        while all(left[s] for s in sets):
            for s in sets:
                i = left[s].pop(0)
                used[i] = True
                taken.append(i)
            if (len(taken) // len(sets) + 1) * len(sets) > n_ubatch:
                break
        ubatches.append(taken)
    return ubatches


def rows_of(order: list[int], rows: dict[int, int]) -> Rows:
    """Each sequence's ``rows[seq]`` rows together, in ``order``."""
    return [seq for seq in order for _ in range(rows[seq])]


def ubatches(order: list[int], rows: dict[int, int]) -> list[list[int]]:
    """The sequence of each row of each ubatch llama.cpp makes of ``order``."""
    batch = rows_of(order, rows)
    return [[batch[i] for i in u] for u in split_equal(batch)]


def runs(rows: dict[int, int]) -> int:
    """Maximal runs of consecutive sequence ids with one row each, and longer chunks."""
    return sum(1 for s in rows if not rows[s] == rows.get(s - 1) == 1)


def test_the_model_cuts_a_prompt_beside_the_decoding_sequence_below_it() -> None:
    # The engine's old order, decoding slots first: slot 1's 8-row chunk after
    # decoding slots 0, 2, 3 went 1 row with slot 0's and 7 later (measured:
    # "Step 1: open the valve." then rounded differently from alone).
    assert ubatches([0, 2, 3, 1], {0: 1, 1: 8, 2: 1, 3: 1}) == [[0, 1], [2, 3], [1] * 7]


@pytest.mark.parametrize("slots", [2, 3, 4, 5, 6])
def test_every_sequence_is_evaluated_whole_in_the_fewest_ubatches(slots: int) -> None:
    """Every assignment of ``slots`` slots to idle (0 rows), decoding (1) or a
    prompt chunk (1, 2 or 7 rows): each sequence's rows are one ubatch, a longer
    chunk alone in it, and there are as many ubatches as runs of consecutive one-row
    ids and longer chunks (no order that keeps them so can have fewer)."""
    for counts in itertools.product((0, 1, 2, 7), repeat=slots):
        rows = {seq: n for seq, n in enumerate(counts) if n}
        if not rows:
            continue
        order = batch_order(rows)
        assert sorted(order) == sorted(rows)
        made = ubatches(order, rows)
        for seq in rows:
            (mine,) = [u for u in made if seq in u]
            assert mine.count(seq) == rows[seq], counts
            assert rows[seq] == 1 or set(mine) == {seq}, counts
        assert len(made) == runs(rows), counts


def test_a_step_of_decoding_slots_keeps_ascending_order() -> None:
    assert batch_order(dict.fromkeys([3, 0, 2, 1], 1)) == [0, 1, 2, 3]
    assert ubatches([0, 1, 2, 3], dict.fromkeys(range(4), 1)) == [[0, 1, 2, 3]]


def test_runs_go_highest_first() -> None:
    assert batch_order({0: 1, 1: 8, 2: 1, 3: 1}) == [2, 3, 1, 0]
    # One-row prompt chunks (a reused prompt's last token) join the decoding ones.
    assert batch_order({0: 1, 1: 1, 2: 1, 3: 1}) == [0, 1, 2, 3]
    # Longer chunks of one length each go alone.
    assert batch_order({0: 5, 1: 5, 3: 1}) == [3, 1, 0]


#: ms per ubatch of 1..8 one-row sequences, measured on an AMD EPYC Zen 5 VM (the
#: default model, one thread; docs/bench/figures.md, "Issue 10: the decode plan").
ZEN5_MS = {1: 13.2, 2: 49.2, 3: 60.1, 4: 68.2, 5: 95.0, 6: 112.2, 7: 100.0, 8: 88.0}


@pytest.mark.parametrize("slots", [2, 3, 4, 5, 6])
def test_a_plans_pieces_are_each_one_ubatch_and_prompt_chunks_stay_whole(slots: int) -> None:
    """With the plan that cuts every run into single rows, and one that cuts runs
    in pairs: each piece the plan names is one ubatch of llama.cpp's split, and
    every prompt chunk is still evaluated whole and alone."""
    singles = DecodePlan.from_costs({g: float(g) * 10 + (g > 1) * 50 for g in range(1, 7)})
    pairs = DecodePlan(((), (1,), (2,), (2, 1), (2, 2), (2, 2, 1), (2, 2, 2)))
    assert singles.cut(4) == (1, 1, 1, 1)
    for plan in (singles, pairs):
        for counts in itertools.product((0, 1, 7), repeat=slots):
            rows = {seq: n for seq, n in enumerate(counts) if n}
            if not rows:
                continue
            made = ubatches(batch_order(rows, plan), rows)
            for seq, n in rows.items():
                (mine,) = [u for u in made if seq in u]
                assert mine.count(seq) == n, counts
                assert n == 1 or set(mine) == {seq}, counts
            decoding = sorted(len(u) for u in made if all(rows[s] == 1 for s in u))
            one_row_runs = [len(r) for r in _one_row_runs(rows)]
            assert decoding == sorted(p for n in one_row_runs for p in plan.cut(n)), counts


def _one_row_runs(rows: dict[int, int]) -> list[list[int]]:
    runs_: list[list[int]] = []
    for seq in sorted(s for s, n in rows.items() if n == 1):
        if runs_ and runs_[-1][-1] == seq - 1:
            runs_[-1].append(seq)
        else:
            runs_.append([seq])
    return runs_


def test_the_zen5_costs_cut_up_to_six_decoding_slots_and_keep_eight_together() -> None:
    plan = DecodePlan.from_costs(ZEN5_MS)
    assert plan.cut(2) == (1, 1)
    assert plan.cut(4) == (1, 1, 1, 1)
    assert plan.cut(8) == (8,)
    assert ubatches(batch_order(dict.fromkeys(range(4), 1), plan), dict.fromkeys(range(4), 1)) == [
        [3],
        [2],
        [1],
        [0],
    ]


def test_a_cut_needs_the_margin_and_cheap_batches_stay_together() -> None:
    # Batching pays (Zen 4 and Xeon: 4 rows at 1.3-1.55x one row's tokens/s).
    assert DecodePlan.from_costs({1: 20.0, 2: 38.0, 3: 50.0, 4: 56.0}).cut(4) == (4,)
    # 4 singles predicted 5 % cheaper than one ubatch of 4: within the margin, kept whole.
    assert DecodePlan.from_costs({1: 10.0, 2: 20.0, 3: 30.0, 4: 42.0}).cut(4) == (4,)
    # 20 % cheaper: cut.
    assert DecodePlan.from_costs({1: 10.0, 2: 25.0, 3: 38.0, 4: 50.0}).cut(4) == (1, 1, 1, 1)


def test_a_run_longer_than_the_plan_is_cut_by_its_longest_rule() -> None:
    plan = DecodePlan.from_costs({1: 10.0, 2: 40.0})
    assert plan.cut(5) == (1, 1, 1, 1, 1)
    assert DecodePlan.together(4).cut(6) == (4, 2)
    assert not DecodePlan.together(4).splits
    assert plan.splits


def test_costs_must_cover_every_size() -> None:
    with pytest.raises(ValueError, match="every size"):
        DecodePlan.from_costs({1: 10.0, 3: 20.0})
    with pytest.raises(ValueError, match="every size"):
        DecodePlan.from_costs({1: 0.0})
