"""``node.llama.candidates.TopK`` without a model: llama.cpp's own sampler chain
(mask, top_k 40, top_p, min_p, temperature, seeded draw) picks the same token from
a row's 40 highest unmasked logits as from the whole row, draw after draw, and the
candidates are declined exactly when their order is not unique (a tie, a NaN)."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp.llama_cpp as llama_c
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from node.llama.candidates import GROUP, SPARE_GROUPS, TopK

K = 40
MIN_P = 0.05


def chain(n_vocab: int, masked: np.ndarray, seed: int, temperature: float, top_p: float) -> Any:
    """The chain ``LlamaEngine._sampler`` builds for a request without a schema."""
    ids = np.flatnonzero(masked)
    bias = (llama_c.llama_logit_bias * len(ids))(
        *(llama_c.llama_logit_bias(int(i), float("-inf")) for i in ids)
    )
    made = llama_c.llama_sampler_chain_init(llama_c.llama_sampler_chain_default_params())
    for sampler in (
        llama_c.llama_sampler_init_logit_bias(n_vocab, len(ids), bias),
        llama_c.llama_sampler_init_top_k(K),
        llama_c.llama_sampler_init_top_p(top_p, 1),
        llama_c.llama_sampler_init_min_p(MIN_P, 1),
        llama_c.llama_sampler_init_temp(temperature),
        llama_c.llama_sampler_init_dist(seed),
    ):
        llama_c.llama_sampler_chain_add(made, sampler)
    return made


def whole_row(sampler: Any, logits: np.ndarray) -> int:
    """What ``llama_sampler_sample`` does with a row (src/llama-sampler.cpp): every
    id in order, unsorted, the chain applied, the selected id accepted."""
    data = (llama_c.llama_token_data * logits.size)()
    view: Any = np.ctypeslib.as_array(data)
    view["id"] = np.arange(logits.size)
    view["logit"] = logits
    array = llama_c.llama_token_data_array(data, logits.size, -1, False)
    llama_c.llama_sampler_apply(sampler, ctypes.byref(array))
    token = int(data[array.selected].id)
    llama_c.llama_sampler_accept(sampler, token)
    return token


def expected(logits: np.ndarray, masked: np.ndarray) -> list[int] | None:
    """The K highest unmasked ids, highest first, or None if their order is not unique."""
    if np.isnan(logits).any():
        return None
    ids = np.flatnonzero(~masked)
    order = ids[np.argsort(-logits[ids], kind="stable")[: K + 1]]
    top = logits[order]
    return None if (top[:-1] == top[1:]).any() else [int(i) for i in order[:K]]


@st.composite
def rows(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """(logits, masked): a vocabulary with a tail beyond the last full group, masked
    ids (some with the highest logits, at most ``SPARE_GROUPS`` of them), and at
    times a tie among the highest or a NaN."""
    n = draw(st.sampled_from([GROUP * (K + 1 + SPARE_GROUPS) + 3, 8192, 20_000]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = (rng.standard_normal(n) * draw(st.sampled_from([1.0, 4.0]))).astype(np.float32)
    masked = np.zeros(n, dtype=bool)
    masked[: draw(st.integers(0, 100))] = True
    masked[n - draw(st.integers(0, 70)) :] = True
    high = rng.choice(n, draw(st.integers(0, SPARE_GROUPS)), replace=False)
    masked[high] = True
    logits[high] = logits.max() + 1.0
    order = np.argsort(-np.where(masked, -np.inf, logits))
    tie = draw(st.sampled_from([None, 0, 5, K - 1, K]))
    if tie is not None:  # the (tie+1)-th highest unmasked equals the (tie+2)-th
        logits[order[tie + 1]] = logits[order[tie]]
    if draw(st.booleans()) and draw(st.booleans()):
        logits[rng.integers(n)] = np.nan
    return logits, masked


@settings(max_examples=60, deadline=None)
@given(rows())
def test_the_candidates_are_the_highest_unmasked_or_none_when_their_order_is_not_unique(
    row: tuple[np.ndarray, np.ndarray],
) -> None:
    logits, masked = row
    found = TopK(masked, K).candidates(logits)
    want = expected(logits, masked)
    if want is None:
        assert found is None
    else:
        assert found is not None
        assert found[0].tolist() == want
        assert found[1].tolist() == logits[want].tolist()


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**31),
    st.sampled_from([0.3, 0.8, 1.0, 1.7]),
    st.sampled_from([0.5, 0.9, 0.95, 1.0]),
    st.integers(0, 2**32 - 1),
)
def test_the_chain_picks_the_same_token_from_the_candidates_as_from_the_whole_row(
    seed: int, temperature: float, top_p: float, data_seed: int
) -> None:
    """Two twin chains (same seed): one always given the whole row, the other the
    candidates when ``TopK.sample`` takes them (the whole row otherwise, as the
    engine does). Thirty draws: the same token each time, the RNGs in step."""
    n = 8192 + 17
    rng = np.random.default_rng(data_seed)
    masked = np.zeros(n, dtype=bool)
    masked[[0, *range(2, 106)]] = True
    masked[n - 40 :] = True
    top_k = TopK(masked, K)
    whole = chain(n, masked, seed, temperature, top_p)
    fast = chain(n, masked, seed, temperature, top_p)
    # Distinct logits, so that no draw is declined (a tie among the highest).
    spread = (np.sinh(np.linspace(-3.0, 3.0, n)) * 2).astype(np.float32)
    assert np.unique(spread).size == n
    taken = 0
    try:
        for _ in range(30):
            logits = rng.permutation(spread)
            logits[rng.integers(0, 106)] = logits.max() + 2  # a masked id above all
            token = top_k.sample(fast, logits)
            taken += token is not None
            if token is None:
                token = whole_row(fast, logits)
            assert token == whole_row(whole, logits)
    finally:
        llama_c.llama_sampler_free(whole)
        llama_c.llama_sampler_free(fast)
    assert taken == 30


def test_a_vocabulary_too_small_for_the_bound_is_always_declined() -> None:
    n = GROUP * (K + 1 + SPARE_GROUPS) - 1
    logits = np.arange(n, dtype=np.float32)
    assert TopK(np.zeros(n, dtype=bool), K).candidates(logits) is None
