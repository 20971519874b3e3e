"""How many decoding slots share a ubatch: the decode plan of the batched llama engine.

Each decoding slot adds one row to a step. llama.cpp evaluates the rows of
consecutive sequence ids together, as one ubatch (``node.llama.slots.batch_order``
says how the batch's order decides that), and a ubatch of g rows costs its
matrix products once for g rows. Whether that is cheaper than g ubatches of one
row depends on the CPU's kernels, not on the model alone: ggml-cpu takes its
matrix-vector path for one row and its matrix-matrix paths (llamafile's
tinyBLAS, the repacked kernels) for more. Measured on an AMD EPYC Zen 5 VM, the
default model, one thread (``docs/bench/figures.md``, "Issue 10: the decode
plan"): a ubatch of 1 row 13 ms, of 2 rows 49 ms, of 4 rows 68 ms, of 8 rows
88 ms. There, 4 slots decode faster as 4 ubatches of one row (4 x 13 ms) than as
one of four, and 8 faster as one of eight. On the Zen 4 and Xeon machines of
earlier figures 4 rows together were 1.3-1.55x one row's tokens per second.

So the engine times one ubatch of each size 1..S when it loads
(``LlamaEngine._ubatch_costs``) and ``DecodePlan.from_costs`` cuts each run of
decoding slots into the pieces that cost least. One llama_decode call still
carries the whole step: the pieces are ubatches inside it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

#: A cut must be predicted this much cheaper than the run in one ubatch to be
#: taken: the timings are medians of a few steps on a machine whose speed drifts
#: by a few percent, and a cut that is not clearly cheaper is not worth the
#: change of rounding (another kernel path) it brings.
SPLIT_MARGIN = 0.10


@dataclass(frozen=True)
class DecodePlan:
    """The pieces a run of consecutive decoding slots is cut into, by run length.

    ``pieces[n]`` (n >= 1) sums to n, largest piece first; a run longer than the
    table is cut by its longest entry's rule, repeatedly (``cut``).
    """

    pieces: tuple[tuple[int, ...], ...] = ((), (1,))

    @classmethod
    def together(cls, slots: int) -> DecodePlan:
        """Every run in one ubatch (llama.cpp's own way; the engine's before calibrating)."""
        return cls(((), *((n,) for n in range(1, max(1, slots) + 1))))

    @classmethod
    def from_costs(cls, costs: Mapping[int, float], margin: float = SPLIT_MARGIN) -> DecodePlan:
        """The cheapest cut of each run length 1..max(costs) into ubatches, from
        ``costs[g]`` (s per ubatch of g rows, g = 1..S, each measured): a cut is
        taken only when it is predicted ``margin`` cheaper than the run whole.

        Raises:
            ValueError: a size from 1 to the largest is missing, or a cost is not
                positive.
        """
        top = max(costs, default=0)
        if top < 1 or any(costs.get(g, 0.0) <= 0.0 for g in range(1, top + 1)):
            raise ValueError(f"costs must be positive for every size 1..{top}: {dict(costs)}")
        best: list[float] = [0.0]
        pieces: list[tuple[int, ...]] = [()]
        for n in range(1, top + 1):
            # The cheapest first piece g, the rest cut at its best (which is a cut
            # taken by the same rule, so a chosen cut is never worse than the margin).
            g = min(range(1, n + 1), key=lambda size: costs[size] + best[n - size])
            cut = costs[g] + best[n - g]
            if g < n and cut > (1 - margin) * costs[n]:
                g, cut = n, costs[n]
            best.append(cut)
            pieces.append(tuple(sorted((g, *pieces[n - g]), reverse=True)))
        return cls(tuple(pieces))

    def cut(self, n: int) -> tuple[int, ...]:
        """The piece sizes of a run of ``n`` decoding slots, largest first."""
        if n <= 0:
            return ()
        top = len(self.pieces) - 1
        if n <= top:
            return self.pieces[n]
        return tuple(sorted(self.pieces[top] + self.cut(n - top), reverse=True))

    @property
    def splits(self) -> bool:
        """Whether any run is cut (else the plan is llama.cpp's own: ``together``)."""
        return any(len(p) > 1 for p in self.pieces[1:])

    def describe(self) -> str:
        """``1: 1; 2: 1+1; 4: 1+1+1+1`` for the log and the docs."""
        return "; ".join(
            f"{n}: {'+'.join(map(str, p))}" for n, p in enumerate(self.pieces) if n >= 1
        )
