"""The per-request service model: prefill and decode rates learned per engine kind.

One mean service time per engine cannot tell a 1000-token
prompt from a 10-token one. A model request costs two phases that llama.cpp
times apart after every request ("prompt eval time = … ms per token" and
"eval time = … ms per token": ``llama_perf_context_print`` in the library,
``server_slot::print_timings`` in its server, whose prompt phase ends when the
first token is sampled):

* **prefill** evaluates the prompt in batches: its time grows with the prompt's
  tokens and ends when the first token is sampled;
* **decode** runs one step per generated token.

So ``service ~ prefill_s_per_token * prompt_tokens + decode_s_per_token * tokens``,
the first decode step being part of the time to the first token. Both rates are
learned, per engine kind, from the broker's own clock on finished requests
(dispatch, first PARTIAL, FINAL) and the worker's ``usage``; nothing is assumed
about the model. Each rate is an exponentially weighted *ratio of sums* (time
over tokens, like llama.cpp's "ms per token"), so long prompts, which carry
the signal, weigh more than short ones, whose time is mostly fixed overhead.

A llama slot reuses the KV cache of its previous prompt's common prefix; the
worker reports those tokens (``usage.cached_tokens``), and the prefill rate is
learned from the tokens evaluated. Predictions count the whole prompt: a
request that reuses a prefix is predicted slower than it is, never faster.

**Batch level.** A worker with S slots decodes all its running sequences in one
``llama_decode`` per step, so a sequence's ms/token depends on how many run
beside it. Each rate is therefore a small table keyed by the *batch level* b,
the number of requests running on the worker (the request itself included):
for a finished request, the time-weighted mean of that count over its prefill
and over its decode (``broker.batch_levels.BatchLevels``), rounded to the nearest integer. A level
not measured yet is predicted from the nearest measured one (in ratio, the
higher on a tie): decode scaled by ``batch_cost`` (the per-sequence step time
measured with batched decoding, ``BATCH_GAIN``), prefill unscaled (see ``batch_cost``). A
worker with one slot only ever runs at level 1, which is the single rate it
always had.

Two more ratios turn a request into tokens without tokenizing it on the
broker's loop (milliseconds per request: docs/bench/figures.md, "broker.service_model"): prompt
tokens per byte of ``byte_bound`` (the exact count is used when the 413 check
made one anyway), and the share of ``max_tokens`` that requests actually
generate (most stop before the limit).

**Pauses.** A pause inside a request (the broker or a worker SIGSTOPped, a VM
stall, a worker stall shorter than liveness) is counted by the broker's clock
as service: one such sample can multiply a rate many times over, admission
then refuses every short-budget request (``deadline_unmeetable``) and, the
refused requests teaching nothing, the rate would stay wrong. So each time rate
(prefill, decode) judges a sample against its current value at that batch level
(``Ratio.add_time``): a rate more than ``OUTLIER_FACTOR`` times above it is
held back, not learned. One pause inflates only the requests in flight
during it, which overlap in time; a real change of speed (another tenant on the
CPU, thermal throttling) goes on: once ``OUTLIER_STREAK`` held samples came one
after another (each dispatched after the previous one finished), the held
samples are learned. Only samples above are judged: too low an estimate heals
by itself (the requests it admits teach it), too high a one does not (refused
requests teach nothing); ``broker.admission``'s probe tests an estimate that
refuses. Fast samples are common and noisy (a broker that reads a request's
tokens late sees its decode as short: restarting a rate from such a sample let
a long-prompt burst in to expire, tests/integration/test_flood.py), so they
are learned as any other.

``ServiceModel`` owns these rates; ``broker.service_time.ServiceEstimator``
asks it whenever a kind is ``ready`` and predicts by the mean before.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

from broker.client_request import ClientRequest
from broker.kinds import EngineKind
from broker.token_count import byte_bound

#: Prompts shorter than this teach no prefill rate: their time to the first token
#: is mostly fixed per-request overhead, not prompt evaluation, and would price long
#: prompts far too high (test_tiny_prompts_and_schema_requests_teach_no_rates).
MIN_PREFILL_TOKENS = 32

#: Weight of the newest sample, in the rates' ratios and the mean service time:
#: about the last 10 requests count.
ALPHA = 0.2

#: A time sample (s per token) more than this many times above its rate at the
#: same batch level is an outlier (a pause inside it, see the module docstring).
#: A judgement, not a measurement. A pause is diluted by the request's tokens: the
#: break2 report's 4 s pause in an 8-token chat was a 25x sample (22.6 -> 570
#: ms/token), but 3 s in a 24-token one at ~40 ms/token on a loaded box is only 3.7x
#: (tests/integration/test_broker_pause_admission.py). How far a healthy engine's samples at
#: one level stray is not measured; the cost of a factor too tight is small, as a
#: lasting change beyond it is learned after ``OUTLIER_STREAK`` requests, while one
#: too loose lets pauses through.
OUTLIER_FACTOR = 2.0

#: Held outliers in a row, each dispatched after the previous one finished, that
#: prove a real change of speed: they are then learned. Samples of one pause overlap
#: in time and count once.
OUTLIER_STREAK = 3

#: Aggregate decode tokens/s of b sequences in one llama context, as a multiple
#: of one sequence's: the midpoints of the ranges measured with one thread
#: (measured: docs/bench/figures.md, "broker.service_model"). Two threads scale
#: further, so it errs on the slow side; it is only used for levels not measured yet.
BATCH_GAIN = ((1, 1.0), (2, 1.0), (4, 1.425), (8, 1.8), (16, 2.25))


def batch_cost(level: float) -> float:
    """One sequence's decode time per token at batch ``level``, as a multiple of
    its time alone: ``level / gain(level)``, the gain (``BATCH_GAIN``)
    interpolated linearly in log2(level) and held at its last value beyond 16
    (so the cost then grows linearly: no further gain is assumed). 2.8 at 4 and
    4.4 at 8, inside the measured per-sequence ranges (docs/bench/figures.md).

    Prefill is not scaled by it: a prompt is evaluated in chunks of up to
    ``n_batch`` tokens in the same ``llama_decode`` as the other slots' one token
    each (``node.llama.engine``'s step), which adds little to a step that is
    already compute-bound, so an unmeasured level borrows the nearest level's
    prefill rate as it is (the first request measured there corrects it).
    """
    level = max(1.0, level)
    x = math.log2(level)
    gain = BATCH_GAIN[-1][1]
    for (b0, g0), (b1, g1) in itertools.pairwise(BATCH_GAIN):
        x0, x1 = math.log2(b0), math.log2(b1)
        if x <= x1:
            gain = g0 + (g1 - g0) * (x - x0) / (x1 - x0)
            break
    return level / gain


def level_key(level: float) -> int:
    """The table key of a (time-weighted, fractional) batch level: the nearest
    integer, halves up, at least 1."""
    return max(1, int(level + 0.5))


@dataclass
class Ratio:
    """``num / den`` over recent samples: both sums decay by ``1 - ALPHA`` per new
    sample. Every sample starts with the same weight (the first one too: the
    first request after a start is often slow, its weights still being paged in).
    Time rates learn through ``add_time``, which holds back outliers (pauses)."""

    num: float = 0.0
    den: float = 0.0
    samples: int = 0
    _held: list[tuple[float, float]] = field(default_factory=list, repr=False)
    _streak: int = field(default=0, repr=False)
    _held_until: float | None = field(default=None, repr=False)

    def add(self, num: float, den: float) -> None:
        """Fold in one sample."""
        self.num = (1 - ALPHA) * self.num + num
        self.den = (1 - ALPHA) * self.den + den
        self.samples += 1

    def add_time(self, num: float, den: float, started: float, ended: float) -> bool:
        """Fold in one time sample (``num`` s over ``den`` tokens) of a request
        dispatched at ``started`` and finished at ``ended`` (the broker's clock, s)
        unless it is an outlier above the current value (``OUTLIER_FACTOR`` times
        it): that one is held back.
        Held samples are all folded in once ``OUTLIER_STREAK`` of them came in a
        row without overlapping (a real change of speed, not one pause); an
        ordinary sample drops them. Returns whether it was folded in now.
        """
        value = self.value
        if den <= 0 or num / den <= value * OUTLIER_FACTOR or value <= 0:
            self.add(num, den)
            self._held.clear()
            self._streak, self._held_until = 0, None
            return True
        self._held.append((num, den))
        if self._held_until is None or started >= self._held_until:
            self._streak += 1  # a request of its own, not one more of the same pause
        self._held_until = max(ended, self._held_until or ended)
        if self._streak < OUTLIER_STREAK:
            return False
        for held in self._held:
            self.add(*held)
        self._held.clear()
        self._streak, self._held_until = 0, None
        return True

    @property
    def value(self) -> float:
        """The ratio; 0.0 before any sample with a non-zero denominator."""
        return self.num / self.den if self.den > 0 else 0.0


@dataclass
class Rates:
    """What one engine kind's finished requests taught (see the module docstring):
    prefill and decode seconds per token by batch level, and the request-to-tokens
    ratios (which do not depend on the level)."""

    prefill_s_per_token: dict[int, Ratio] = field(default_factory=dict)
    decode_s_per_token: dict[int, Ratio] = field(default_factory=dict)
    tokens_per_byte: Ratio = field(default_factory=Ratio)
    completion_share: Ratio = field(default_factory=Ratio)

    def prefill(self, level: int) -> float:
        """Prefill s/token at ``level``: measured, else the nearest measured level's."""
        return _at_level(self.prefill_s_per_token, level, scaled=False)

    def decode(self, level: int) -> float:
        """Decode s/token at ``level``: measured, else the nearest measured level's
        scaled by ``batch_cost``; 0.0 before any decode was measured."""
        return _at_level(self.decode_s_per_token, level, scaled=True)


def _at_level(table: dict[int, Ratio], level: int, *, scaled: bool) -> float:
    """``table``'s rate at ``level`` (see ``Rates.prefill`` / ``Rates.decode``)."""
    level = max(1, level)
    measured = [b for b, r in table.items() if r.den > 0]
    if not measured:
        return 0.0
    if level in measured:
        return table[level].value
    # Nearest in ratio (log distance), the higher level on a tie (the slower guess).
    nearest = min(measured, key=lambda b: (abs(math.log(b / level)), -b))
    rate = table[nearest].value
    return rate * batch_cost(level) / batch_cost(nearest) if scaled else rate


class ServiceModel:
    """Per engine kind: prefill and decode rates, and the request-to-tokens ratios."""

    def __init__(self) -> None:
        self._rates: dict[EngineKind, Rates] = {}

    def ready(self, kind: EngineKind) -> bool:
        """Whether ``kind`` has a measured rate to predict from, at any batch level:
        a decode rate (any request that generated two tokens or more) or a prefill
        rate (one that evaluated ``MIN_PREFILL_TOKENS`` or more); until then the
        mean decides. A rate not measured yet counts 0 s per token, so a prediction
        is then a lower bound, which admits rather than refuses (a node serving
        only short IoT commands never measures prefill, and by the mean it admitted
        200 tokens for a 300 ms budget: tests/unit/test_admission_sized.py)."""
        rates = self._rates.get(kind)
        if rates is None:
            return False
        tables = (rates.prefill_s_per_token, rates.decode_s_per_token)
        return any(r.den > 0 for table in tables for r in table.values())

    def observe(
        self,
        kind: EngineKind,
        req: ClientRequest,
        max_tokens: int,
        ttft_s: float,
        total_s: float,
        usage: object,
        prefill_level: float = 1.0,
        decode_level: float = 1.0,
        started: float = 0.0,
    ) -> bool:
        """Learn from one successful request.

        Args:
            kind: the engine that served it.
            req: the request (its prompt's ``byte_bound``).
            max_tokens: the limit the worker was given (tokens).
            ttft_s: dispatch to the first PARTIAL (s): prefill plus one decode step.
            total_s: dispatch to the FINAL (s).
            usage: the FINAL's ``usage`` map: ``prompt_tokens``, ``completion_tokens``,
                and ``cached_tokens`` (prompt tokens a slot reused: not evaluated,
                so they teach no prefill rate).
            prefill_level: requests running on its worker during its prefill
                (itself included; a time-weighted mean, ``broker.batch_levels.BatchLevels``).
            decode_level: the same during its decode.
            started: when it was dispatched (the broker's clock, s): with
                ``total_s``, the span that tells one pause's outliers from a
                change of speed (``Ratio.add_time``).

        Returns:
            False if the sample says nothing about size (no usage, no token
            generated, as from the rule engine) or would mislead it (a
            ``json_schema`` request: its grammar slows every step several times
            over, docs/bench/figures.md): nothing was learned.
        """
        if not isinstance(usage, dict) or req.json_schema is not None:
            return False
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not _count(prompt) or not _count(completion):
            return False
        assert isinstance(prompt, int) and isinstance(completion, int)
        rates = self._rates.setdefault(kind, Rates())
        ended = started + total_s
        at_prefill, at_decode = level_key(prefill_level), level_key(decode_level)
        if completion >= 2:
            decode = rates.decode_s_per_token.setdefault(at_decode, Ratio())
            decode.add_time(max(0.0, total_s - ttft_s), completion - 1, started, ended)
        first_step = rates.decode(at_prefill)  # the first token ends the prefill
        # A slot's prompt prefix reuse: only the rest was evaluated.
        cached = usage.get("cached_tokens")
        reused = cached if isinstance(cached, int) and _count(cached) and cached <= prompt else 0
        evaluated = prompt - reused
        if evaluated >= MIN_PREFILL_TOKENS:
            prefill = rates.prefill_s_per_token.setdefault(at_prefill, Ratio())
            prefill.add_time(max(0.0, ttft_s - first_step), evaluated, started, ended)
        rates.tokens_per_byte.add(prompt, byte_bound(req))
        rates.completion_share.add(completion, max(1, max_tokens))
        return True

    def prompt_tokens(self, kind: EngineKind, req: ClientRequest) -> float | None:
        """``req``'s prompt tokens estimated from its bytes, None before any sample."""
        if not self.ready(kind):
            return None
        return byte_bound(req) * self._rates[kind].tokens_per_byte.value

    def predict_s(
        self, kind: EngineKind, prompt_tokens: float, max_tokens: int, level: int = 1
    ) -> float:
        """Predicted dispatch-to-final time (s) of a request of ``prompt_tokens``
        allowed ``max_tokens``, run at batch ``level``: prefill rate x prompt
        tokens + decode rate x the tokens it is expected to generate
        (``max_tokens`` x the observed share). Call only when ``ready(kind)``."""
        rates = self._rates[kind]
        expected = max_tokens * min(1.0, rates.completion_share.value)
        return rates.prefill(level) * prompt_tokens + rates.decode(level) * expected

    def first_token_s(self, kind: EngineKind, prompt_tokens: float, level: int = 1) -> float:
        """Predicted dispatch-to-first-token time (s) at batch ``level``: the
        prefill of ``prompt_tokens`` and one decode step (llama.cpp samples the
        first token at the end of the prompt's evaluation). Call only when
        ``ready(kind)``."""
        rates = self._rates[kind]
        return rates.prefill(level) * prompt_tokens + rates.decode(level)

    def snapshot(self, kind: EngineKind) -> dict[str, float] | None:
        """The learned rates of ``kind`` in ms per token (for logs and benchmarks):
        prefill and decode at batch level 1 (measured, or derived from the nearest
        measured level as for any prediction)."""
        if not self.ready(kind):
            return None
        r = self._rates[kind]
        return {
            "prefill_ms_per_token": round(r.prefill(1) * 1000, 3),
            "decode_ms_per_token": round(r.decode(1) * 1000, 3),
            "tokens_per_byte": round(r.tokens_per_byte.value, 3),
            "completion_share": round(r.completion_share.value, 3),
        }

    def decode_by_level(self, kind: EngineKind) -> dict[str, float]:
        """The decode rate (ms per token) at every batch level measured, keyed by
        the level as a string (msgpack maps on the wire must have string keys),
        lowest first; empty before any."""
        rates = self._rates.get(kind)
        if rates is None:
            return {}
        return {
            str(level): round(ratio.value * 1000, 3)
            for level, ratio in sorted(rates.decode_s_per_token.items())
            if ratio.den > 0
        }


def _count(value: object) -> bool:
    """A positive token count (bools are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
