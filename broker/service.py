"""A request's own service time, predicted from its size.

One mean service time per engine (``broker.stats``) cannot tell a 1000-token
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

The rates are effective ones: llama-cpp-python reuses the KV cache of the
previous prompt's common prefix on the same worker, so traffic that repeats a
long prefix teaches a lower prefill rate per (reported) prompt token.

Two more ratios turn a request into tokens without tokenizing it on the
broker's loop (~1.6 ms for 2 KB with the default model's vocabulary): prompt
tokens per byte of ``byte_bound`` (the exact count is used when the 413 check
made one anyway), and the share of ``max_tokens`` that requests actually
generate (most stop before the limit).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from broker.protocol import ClientRequest

#: Template tokens a chat message may add around its content (role markers,
#: turn delimiters): Gemma's template uses 4-5.
CHAT_TOKENS_PER_MESSAGE = 6

#: Prompts shorter than this teach no prefill rate: their time to the first token
#: is mostly fixed per-request overhead, not prompt evaluation. A 3-token "warm up"
#: taught 44 ms/token where the model evaluates 7-9, and a 1700-token prompt that
#: takes 15 s was then refused as needing 85 s (break-it session).
MIN_PREFILL_TOKENS = 32

#: Weight lost per newer sample, as ``broker.stats.Stats.ALPHA``: about the
#: last 10 requests count.
ALPHA = 0.2


def byte_bound(req: ClientRequest) -> int:
    """An upper bound on the prompt's tokens without tokenizing: every token of a
    byte-level BPE or SentencePiece (byte-fallback) vocabulary covers at least one
    byte, plus BOS and the chat template's tokens per message."""
    if req.prompt is not None:
        return len(req.prompt.encode()) + 1
    messages = req.messages or ()
    text = sum(len(content.encode()) for _, content in messages)
    return text + 1 + CHAT_TOKENS_PER_MESSAGE * len(messages)


@dataclass
class Ratio:
    """``num / den`` over recent samples: both sums decay by ``1 - ALPHA`` per new
    sample. Every sample starts with the same weight (the first one too: the
    first request after a start is often slow, its weights still being paged in)."""

    num: float = 0.0
    den: float = 0.0
    samples: int = 0

    def add(self, num: float, den: float) -> None:
        """Fold in one sample."""
        self.num = (1 - ALPHA) * self.num + num
        self.den = (1 - ALPHA) * self.den + den
        self.samples += 1

    @property
    def value(self) -> float:
        """The ratio; 0.0 before any sample with a non-zero denominator."""
        return self.num / self.den if self.den > 0 else 0.0


@dataclass
class Rates:
    """What one engine kind's finished requests taught (see the module docstring)."""

    prefill_s_per_token: Ratio = field(default_factory=Ratio)
    decode_s_per_token: Ratio = field(default_factory=Ratio)
    tokens_per_byte: Ratio = field(default_factory=Ratio)
    completion_share: Ratio = field(default_factory=Ratio)


class ServiceModel:
    """Per engine kind: prefill and decode rates, and the request-to-tokens ratios."""

    def __init__(self) -> None:
        self._rates: dict[str, Rates] = {}

    def ready(self, kind: str) -> bool:
        """Whether ``kind`` has a measured request to predict from (one with a
        prompt of at least ``MIN_PREFILL_TOKENS``: until then the mean decides)."""
        rates = self._rates.get(kind)
        return rates is not None and rates.prefill_s_per_token.samples > 0

    def observe(
        self,
        kind: str,
        req: ClientRequest,
        max_tokens: int,
        ttft_s: float,
        total_s: float,
        usage: object,
    ) -> bool:
        """Learn from one successful request.

        Args:
            kind: the engine that served it.
            req: the request (its prompt's ``byte_bound``).
            max_tokens: the limit the worker was given (tokens).
            ttft_s: dispatch to the first PARTIAL (s): prefill plus one decode step.
            total_s: dispatch to the FINAL (s).
            usage: the FINAL's ``usage`` map: ``prompt_tokens``, ``completion_tokens``.

        Returns:
            False if the sample says nothing about size (no usage, no token
            generated, as from the rule engine) or would mislead it (a
            ``json_schema`` request: its grammar slows every step, 485 ms/token
            learned where plain decoding takes 60-90): nothing was learned.
        """
        if not isinstance(usage, dict) or req.json_schema is not None:
            return False
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not _count(prompt) or not _count(completion):
            return False
        assert isinstance(prompt, int) and isinstance(completion, int)
        rates = self._rates.setdefault(kind, Rates())
        if completion >= 2:
            rates.decode_s_per_token.add(max(0.0, total_s - ttft_s), completion - 1)
        first_step = rates.decode_s_per_token.value
        if prompt >= MIN_PREFILL_TOKENS:
            rates.prefill_s_per_token.add(max(0.0, ttft_s - first_step), prompt)
        rates.tokens_per_byte.add(prompt, byte_bound(req))
        rates.completion_share.add(completion, max(1, max_tokens))
        return True

    def prompt_tokens(self, kind: str, req: ClientRequest) -> float | None:
        """``req``'s prompt tokens estimated from its bytes, None before any sample."""
        if not self.ready(kind):
            return None
        return byte_bound(req) * self._rates[kind].tokens_per_byte.value

    def predict_s(self, kind: str, prompt_tokens: float, max_tokens: int) -> float:
        """Predicted dispatch-to-final time (s) of a request of ``prompt_tokens``
        allowed ``max_tokens``: prefill rate x prompt tokens + decode rate x the
        tokens it is expected to generate (``max_tokens`` x the observed share).
        Call only when ``ready(kind)``."""
        rates = self._rates[kind]
        expected = max_tokens * min(1.0, rates.completion_share.value)
        return (
            rates.prefill_s_per_token.value * prompt_tokens
            + rates.decode_s_per_token.value * expected
        )

    def first_token_s(self, kind: str, prompt_tokens: float) -> float:
        """Predicted dispatch-to-first-token time (s): the prefill of
        ``prompt_tokens`` and one decode step (llama.cpp samples the first token
        at the end of the prompt's evaluation). Call only when ``ready(kind)``."""
        rates = self._rates[kind]
        return rates.prefill_s_per_token.value * prompt_tokens + rates.decode_s_per_token.value

    def snapshot(self, kind: str) -> dict[str, float] | None:
        """The learned rates of ``kind`` in ms per token (for logs and benchmarks)."""
        if not self.ready(kind):
            return None
        r = self._rates[kind]
        return {
            "prefill_ms_per_token": round(r.prefill_s_per_token.value * 1000, 3),
            "decode_ms_per_token": round(r.decode_s_per_token.value * 1000, 3),
            "tokens_per_byte": round(r.tokens_per_byte.value, 3),
            "completion_share": round(r.completion_share.value, 3),
        }


def _count(value: object) -> bool:
    """A positive token count (bools are not counts)."""
    return isinstance(value, int) and not isinstance(value, bool) and value > 0
