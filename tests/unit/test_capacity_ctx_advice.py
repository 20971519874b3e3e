"""The "model.n_ctx = N" knob of a refusal: a bisection that answers what the old
256-token walk answered, and answers at once at n_ctx 2**31-1 (the walk took minutes)."""

from __future__ import annotations

import dataclasses

import pytest

from node.capacity.gguf import ModelMeta
from node.capacity.plan import (
    CTX_PAD,
    Plan,
    _replan,
    advice,
    kv_cells,
    largest_fitting_ctx,
    model_plan,
)
from node.config import INT32_MAX
from node.units import parse_size

#: A Gemma-3-270M-like model (18 layers x 1 KV head x 256/256), with no file behind it.
META = ModelMeta(
    path="synthetic.gguf",
    name="synthetic",
    n_layer=18,
    n_head=4,
    n_head_kv=(1,) * 18,
    key_length=256,
    value_length=256,
    weights_bytes=parse_size("253M"),
    n_vocab=262_144,
)


def plan(n_ctx: int, budget: str, workers: int = 2, slots: int = 4) -> Plan:
    return model_plan(
        META,
        budget=parse_size(budget),
        reserve=parse_size("1G"),
        workers=workers,
        slots=slots,
        margin=0.1,
        runtime_overhead=parse_size("88M"),
        weights_shared=True,
        budget_source="test",
        n_ctx=n_ctx,
        n_batch=512,
        kv_type="f16",
        flash_attn=False,
    )


def linear_answer(p: Plan, meta: ModelMeta) -> int | None:
    """The search ``advice`` made before: down from the padded context, 256 at a time."""
    ctxs = range(kv_cells(p.n_ctx) - CTX_PAD, 0, -CTX_PAD)
    return next((n for n in ctxs if _replan(p, meta, n_ctx=n).fits), None)


@pytest.mark.parametrize("n_ctx", [64, 256, 257, 2048, 8192, 32_768, 131_072])
@pytest.mark.parametrize("budget", ["1G", "2G", "2250M", "3G", "8G"])
def test_the_bisection_answers_what_the_linear_search_answered(n_ctx: int, budget: str) -> None:
    p = plan(n_ctx, budget)
    assert largest_fitting_ctx(p, META) == linear_answer(p, META)


def test_a_budget_that_fits_no_context_gets_no_context_advice() -> None:
    p = plan(8192, "1100M")
    assert linear_answer(p, META) is None and largest_fitting_ctx(p, META) is None


def test_the_largest_documented_n_ctx_gets_its_answer() -> None:
    # The walk took minutes here; the per-test timeout is the guard. The answer is
    # the one the walk gives from just above the largest fitting context.
    huge = plan(INT32_MAX, "3G")
    ctx = largest_fitting_ctx(huge, META)
    assert ctx is not None and _replan(huge, META, n_ctx=ctx).fits
    assert not _replan(huge, META, n_ctx=ctx + CTX_PAD).fits
    assert ctx == linear_answer(dataclasses.replace(huge, n_ctx=ctx + 4 * CTX_PAD), META)
    assert f"model.n_ctx = {ctx} (--n-ctx)" in advice(huge, META)
