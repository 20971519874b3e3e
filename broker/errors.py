"""The edgenode error tree: one root, branches by who must react.

Every error that can reach a client maps to one HTTP-aligned wire code (see
``docs/PROTOCOL.md``); the client library turns a wire error back into the same
class, so application code catches ``Overloaded`` whether it came from this
process or from the node.
"""

from __future__ import annotations

from enum import IntEnum


class ErrorCode(IntEnum):
    """Wire error codes, aligned with HTTP status semantics (RFC 9110 §15)."""

    BAD_REQUEST = 400
    NOT_FOUND = 404
    TOO_LARGE = 413
    OVERLOADED = 429
    CANCELLED = 499  # nginx's "client closed request"; the client cancelled it
    INTERNAL = 500
    UNAVAILABLE = 503
    DEADLINE_EXCEEDED = 504


class EdgeNodeError(Exception):
    """Root of every error edgenode raises.

    Attributes:
        code: the wire code a client sees for this error.
        retry_after_ms: when set, retrying after this many milliseconds may succeed.
        partial_text: text generated before the failure (may be empty).
        reason: the machine reason of a refusal (PROTOCOL §5.2: ``queue_full``,
            ``draining``, ``worker_lost``, ...), None when the reply had none.
            Apps branch on it, not on the message.
    """

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(
        self,
        message: str,
        *,
        retry_after_ms: int | None = None,
        partial_text: str = "",
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_ms = retry_after_ms
        self.partial_text = partial_text
        self.reason = reason


class ProtocolError(EdgeNodeError):
    """A message broke the wire protocol (undecodable, wrong frames, bad field): fix the sender."""

    code = ErrorCode.BAD_REQUEST


class NotFound(EdgeNodeError):
    """The referenced request id is not known (e.g. cancel of a finished request)."""

    code = ErrorCode.NOT_FOUND


class TooLarge(EdgeNodeError):
    """The message or the prompt plus ``max_tokens`` does not fit the limits or the context."""

    code = ErrorCode.TOO_LARGE


class Overloaded(EdgeNodeError):
    """A per-client limit was hit (429): slow down and retry after ``retry_after_ms``."""

    code = ErrorCode.OVERLOADED


class Cancelled(EdgeNodeError):
    """The request was cancelled by its client (499)."""

    code = ErrorCode.CANCELLED


class ClientClosed(Cancelled):
    """The client was closed (``Client.close``/``AsyncClient.close``): raised by every
    call still waiting for a reply at that moment and by every call made afterwards.

    A ``Cancelled`` (499, nginx's "client closed request"), never sent on the wire: the
    client, not the node, ended the request (a request already sent still runs on the
    node until its deadline).
    """


class InternalError(EdgeNodeError):
    """A bug or an engine failure inside the node (500)."""

    code = ErrorCode.INTERNAL


class Unavailable(EdgeNodeError):
    """The node cannot serve now (503): overload, no worker, worker lost."""

    code = ErrorCode.UNAVAILABLE


class NoReply(Unavailable):
    """The client library heard no reply from the node in time (never sent on the wire).

    A 503 like the node's own refusals, raised by ``broker.client`` when a reply does
    not come within its wait: the node is stopped, gone, hung or unreachable.
    """


class DeadlineExceeded(EdgeNodeError):
    """The request's ``timeout_ms`` budget ran out (504); ``partial_text`` holds what was made."""

    code = ErrorCode.DEADLINE_EXCEEDED


class ConfigError(EdgeNodeError):
    """The node's configuration is invalid or cannot be satisfied on this host."""

    code = ErrorCode.INTERNAL


class SandboxError(EdgeNodeError):
    """cgroups or CPU affinity could not be set up as configured."""

    code = ErrorCode.INTERNAL


#: Wire code -> the class a client raises for it.
ERROR_BY_CODE: dict[int, type[EdgeNodeError]] = {
    ErrorCode.BAD_REQUEST: ProtocolError,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.TOO_LARGE: TooLarge,
    ErrorCode.OVERLOADED: Overloaded,
    ErrorCode.CANCELLED: Cancelled,
    ErrorCode.INTERNAL: InternalError,
    ErrorCode.UNAVAILABLE: Unavailable,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def error_from_wire(
    code: int,
    message: str,
    retry_after_ms: int | None = None,
    partial_text: str = "",
    reason: str | None = None,
) -> EdgeNodeError:
    """Build the typed exception for a wire error reply.

    Args:
        code: the reply's ``code`` field; unknown codes become ``InternalError``.
        message: the reply's ``message`` field.
        retry_after_ms: the reply's ``retry_after_ms`` field, if any.
        partial_text: the reply's ``text`` field, if any.
        reason: the reply's ``reason`` field, if any.
    """
    cls = ERROR_BY_CODE.get(code, InternalError)
    return cls(message, retry_after_ms=retry_after_ms, partial_text=partial_text, reason=reason)
