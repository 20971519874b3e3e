"""What the broker may learn of a prompt's size in tokens, and at what cost.

The node injects a counter built on the model's own vocabulary
(``node.llama.vocab``); the broker core only sees these shapes. Counting runs on
the broker's single loop, so every counter bounds its own work
(``TokenCounter.bounded``) and may answer with a lower bound instead of a count.
Without tokenizing at all, ``byte_bound`` bounds a prompt from above.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from broker.client_request import ClientRequest

#: Template tokens a chat message may add around its content (role markers,
#: turn delimiters): Gemma's template uses 4-5.
CHAT_TOKENS_PER_MESSAGE = 6


@dataclass(frozen=True)
class TokenCount:
    """A prompt's tokens: the count if ``exact``, else a lower bound (over the limit
    asked about, or all the counter's budget allowed: the worker then decides)."""

    tokens: int
    exact: bool


@runtime_checkable
class TokenCounter(Protocol):
    """Counts a request's prompt in tokens, and can answer within a fixed budget of
    work: the node's llama.cpp counter (``node.llama.vocab``), whose exact count of
    a large body can hold the loop for seconds (docs/bench/figures.md,
    "broker.token_count"), or the test engine's word counter (``node.engine.WordCounter``)."""

    def __call__(self, req: ClientRequest) -> int:
        """The exact count, whatever it costs."""

    def bounded(self, req: ClientRequest, limit: int) -> TokenCount:
        """Enough to tell whether the prompt has at most ``limit`` tokens."""


def byte_bound(req: ClientRequest) -> int:
    """An upper bound on the prompt's tokens without tokenizing: every token of a
    byte-level BPE or SentencePiece (byte-fallback) vocabulary covers at least one
    byte, plus BOS and the chat template's tokens per message."""
    if req.prompt is not None:
        return len(req.prompt.encode()) + 1
    messages = req.messages or ()
    text = sum(len(content.encode()) for _, content in messages)
    return text + 1 + CHAT_TOKENS_PER_MESSAGE * len(messages)
