"""What the broker may learn of a prompt's size in tokens, and at what cost.

The node injects a counter built on the model's own vocabulary
(``node.llama.vocab``); the broker core only sees these shapes. Counting runs on
the broker's single loop, so a counter may bound its own work
(``BoundedTokenCounter``) and answer with a lower bound instead of a count.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from broker.protocol import ClientRequest

#: Counts a request's prompt in tokens (the node injects the model's tokenizer).
TokenCounter = Callable[[ClientRequest], int]


@dataclass(frozen=True)
class TokenCount:
    """A prompt's tokens: the count if ``exact``, else a lower bound (over the limit
    asked about, or all the counter's budget allowed: the worker then decides)."""

    tokens: int
    exact: bool


@runtime_checkable
class BoundedTokenCounter(Protocol):
    """A ``TokenCounter`` that can also answer within a fixed budget of work: the
    node's llama.cpp one (``node.llama.vocab``), whose exact count of a 256 KB body
    held the loop for 0.2 s to minutes."""

    def __call__(self, req: ClientRequest) -> int:
        """The exact count, whatever it costs."""

    def bounded(self, req: ClientRequest, limit: int) -> TokenCount:
        """Enough to tell whether the prompt has at most ``limit`` tokens."""
