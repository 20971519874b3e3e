"""A sampler chain's token from its top-K candidates, not from the whole vocabulary.

``llama_sampler_sample`` (llama.cpp src/llama-sampler.cpp) copies every logit of a
row into a ``llama_token_data`` array (262,144 entries for Gemma 3) and runs the
chain over it: about 1 ms of the engine thread per token, during which no slot
decodes (docs/bench/figures.md, "Issue 10"). ``TopK.sample`` finds the K highest
unmasked logits with numpy, runs the same chain over those K candidates only
(``llama_sampler_apply``), then ``llama_sampler_accept``: what
``llama_sampler_sample`` does, on a smaller array.

Why the chain of ``LlamaEngine._sampler`` without a grammar (logit_bias(mask),
top_k(K), top_p, min_p, temp, dist) picks the same token from both arrays, as the
vendored llama.cpp (llama-cpp-python 0.3.36) implements each sampler:

* the chain (``llama_sampler_chain_apply``, no backend sampling) applies its
  samplers in order and nothing else; ``sample`` applies them itself, from the
  second on.
* logit_bias, the first, adds -inf to the masked ids: on the full array the
  masked entries (then -inf) never reach top_k's K highest while K unmasked finite
  logits exist. On the candidates it would find an id at index ``id`` when
  ``data[id].id == id``, else by scanning the array: none is a masked id, so it
  would change nothing, after a scan of its 6,250 biases (Gemma 3) for each of the
  K candidates, ~0.3 ms, as long as the whole chain took. ``sample`` skips it.
* top_k on an unsorted array runs ``std::partial_sort`` (K <= 128) by descending
  logit, keeps the first K and sets ``sorted``. With the full array that is the K
  highest unmasked logits in descending order; with these K candidates it is a
  sort of the same K entries. ``std::partial_sort`` is not stable and orders equal
  logits its own way, depending on the array: so ``sample`` declines (returns
  None) unless the K+1 highest unmasked logits are all distinct. Then the K-th is
  strictly above every other id (the set is the same) and the order is unique.
* From there both arrays are the same K entries, in the same order, ``sorted``
  set, ``size`` K, and no later sampler reads past ``size``: top_p (softmax over
  ``size``, cut at the cumulative p), min_p (the sorted branch: cut at
  ``data[0].logit + log(p)``), temp (divides each logit) and dist (softmax, one
  ``uniform_real_distribution`` draw from its own ``mt19937``, the first index
  whose running sum reaches it) compute the same numbers from the same inputs.
  dist draws once per token on either path, so its RNG stays where the full
  chain would leave it.
* ``llama_sampler_accept`` on the chain: none of these samplers but dist has an
  accept, and dist's does nothing without backend sampling (which the engine
  never enables).

A NaN anywhere in the row (comparisons then no longer order the array) or a tie
among the K+1 highest makes ``sample`` return None; the caller then uses
``llama_sampler_sample``, which has its own rules for those.
"""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp.llama_cpp as llama_c
import numpy as np

#: Ids per group when bounding the K+1-th highest logit: group j holds ids
#: j, j + g, j + 2g, ... for g = n_vocab // 64 (a strided max over a (64, g) view
#: is one vectorised pass, ~8x faster than 64-id contiguous blocks: 31 vs 266 us
#: on Gemma 3's 262,144 logits, here). Spare groups let a few masked ids with high
#: logits (they raise their group's max) not push the bound above the K+1-th
#: unmasked logit.
GROUP = 64
SPARE_GROUPS = 8


class TopK:
    """The K highest unmasked logits of a row, run through a sampler chain.

    Args:
        masked: bool per token id (shape ``(n_vocab,)``), True for ids the chain's
            logit_bias sets to -inf.
        k: the chain's top_k (K), at most 128 (beyond that llama.cpp's top_k
            sorts differently: ``llama_token_data_array_partial_sort``).

    One instance per engine thread: ``sample`` reuses one candidate array. With
    fewer than ``GROUP * (K + 1 + SPARE_GROUPS)`` ids (3,136 for K = 40) it always
    declines: the full chain is cheap there.

    Raises:
        ValueError: ``k`` is not in 1..128.
    """

    def __init__(self, masked: np.ndarray, k: int) -> None:
        if not 1 <= k <= 128:
            raise ValueError("k must be in 1..128")
        self.k = k
        self._masked = masked
        self._groups = masked.size // GROUP
        self._head = self._groups * GROUP  # the ids in groups; the rest are always candidates
        self._tail = np.arange(self._head, masked.size)
        # Id of row r in column j of the (GROUP, groups) view: r * groups + j.
        self._row_ids = (np.arange(GROUP) * self._groups)[:, None]
        self._data = (llama_c.llama_token_data * k)()
        self._view: Any = np.ctypeslib.as_array(self._data)  # fields id, logit, p
        self._array = llama_c.llama_token_data_array(self._data, k, -1, False)

    def candidates(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The ids of the K highest unmasked logits and those logits, highest first
        (shapes ``(K,)``), or None if the order is not unique (a NaN in ``logits``,
        equal logits among the K+1 highest) or fewer than K+1 unmasked ids are found.

        The bound: with ``t`` the (K+1+SPARE_GROUPS)-th highest group maximum, every
        id outside the groups whose maximum is >= ``t`` has a logit < ``t``; so if at
        least K+1 unmasked ids in those groups reach ``t``, they hold the K+1 highest.
        """
        k = self.k
        nth = self._groups - (k + 1 + SPARE_GROUPS)
        if nth < 0:
            return None
        tops = logits[: self._head].reshape(GROUP, self._groups).max(axis=0)
        if np.isnan(tops).any():  # max propagates NaN: any NaN in the groups shows here
            return None
        bound = np.partition(tops, nth)[nth]
        ids = np.concatenate(((self._row_ids + np.flatnonzero(tops >= bound)).ravel(), self._tail))
        values = logits[ids]
        if np.isnan(values[ids.size - self._tail.size :]).any():
            return None
        keep = (values >= bound) & ~self._masked[ids]
        ids, values = ids[keep], values[keep]
        if ids.size <= k:
            return None
        order = np.argsort(values)[: -(k + 2) : -1]  # the K+1 highest, highest first
        top = values[order]
        if not (top[:-1] > top[1:]).all():
            return None
        return ids[order[:k]], top[:k]

    def sample(self, chain: Any, logits: np.ndarray) -> int | None:
        """The token ``chain`` (a ``llama_sampler`` chain as described in the module
        docstring: the mask's logit_bias first, no grammar) picks from ``logits``
        (float32, shape ``(n_vocab,)``), accepted into the chain; None, with the
        chain untouched, when ``candidates`` declines.
        """
        found = self.candidates(logits)
        if found is None:
            return None
        ids, values = found
        view = self._view
        view["id"] = ids
        view["logit"] = values
        view["p"] = 0.0
        array = self._array
        array.size = self.k
        array.selected = -1
        array.sorted = False  # as llama_sampler_sample hands it over
        pointer = ctypes.byref(array)
        for i in range(1, llama_c.llama_sampler_chain_n(chain)):  # 0: the mask (see above)
            llama_c.llama_sampler_apply(llama_c.llama_sampler_chain_get(chain, i), pointer)
        # Every sampler keeps the array's storage (they permute and shrink it in place).
        token = int(self._data[array.selected].id)
        llama_c.llama_sampler_accept(chain, token)
        return token
