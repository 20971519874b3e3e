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
