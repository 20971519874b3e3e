"""The node's and its workers' log lines: plain text, or JSON lines.

``[logging] format = "json"`` (``configure``) writes one JSON object per line
to stderr, with the standard library's ``logging`` and a small ``Formatter``
(``JsonFormatter``): ``ts`` (RFC 3339, UTC, ms), ``level``, ``logger``, ``msg``,
``pid``, ``role`` (``broker``, or the worker's id: ``llm-0``), ``exc`` (a
traceback, when there is one) and the line's own fields. Lines are UTF-8, with
non-ASCII text as is (``"request_id":"ünï"``, what a grep for the id looks for);
anything that could break a line or the encoding is escaped (``_UNSAFE``).

A line's own fields travel in ``extra={"fields": {...}}``, built by
``about_request`` (``request_id``, ``client``: on every line about one request,
so ``grep <id>`` follows it through the broker's and the worker's logs) and
``event_extra`` (a typed ``event`` name, ``LogEvent``, and its fields: from, to,
reason, worker, signal ...). Passing them explicitly at the few call sites that
know them keeps the rest of the code untouched: no context variable has to
follow a request across the worker's engine threads, and a line without fields
is just a line. The text format leaves the fields out: its messages already
say the same in words, as they always did.
"""

from __future__ import annotations

import io
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import IO, Any, Literal, get_args

#: ``[logging] format``: ``text`` (the default, for people) or ``json`` (JSON lines,
#: for journald, Loki, jq).
LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[LogFormat, ...] = get_args(LogFormat)

#: The events logged with a stable ``event`` field (README, "Logs", which also
#: gives each one's level):
#: ``breaker_transition`` (the circuit breaker's state changed: from, to, reason),
#: ``worker_verdict`` (the node gave up on a worker and kills it: worker,
#: worker_pid, verdict, at_limit (a boolean), reason; ``broker.exits.Verdict``),
#: ``worker_exit`` (a worker's process ended: worker, worker_pid, signal, code,
#: verdict, oom_killed, reason) and
#: ``pressure_change`` (the memory or CPU pressure level changed: resource, from, to).
LogEvent = Literal["breaker_transition", "worker_verdict", "worker_exit", "pressure_change"]
LOG_EVENTS: tuple[LogEvent, ...] = get_args(LogEvent)

#: The broker process's ``role``; a worker's is its worker id.
BROKER_ROLE = "broker"

#: The text formats, as they were before JSON lines existed.
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"
WORKER_TEXT_FORMAT = "%(asctime)s %(levelname)s worker[%(process)d] %(message)s"

#: The keys every JSON line has; a line's own fields never replace them (so an
#: event names a worker's pid ``worker_pid``: ``pid`` is the process that logs).
BASE_KEYS = frozenset({"ts", "level", "logger", "msg", "pid", "role", "exc"})


def about_request(request_id: object, client: bytes | None = None, **fields: Any) -> dict[str, Any]:
    """``extra=`` for a line about one request.

    Args:
        request_id: the client's ``id`` (str or int, as the client sent it); never
            the prompt or any other text of the request.
        client: the client's ZeroMQ routing id, logged as hex; None where unknown
            (a worker never knows it).
        fields: more fields of the line (worker, step, status, code, reason); those
            that are None are left out.
    """
    own: dict[str, Any] = {"request_id": request_id}
    if client is not None:
        own["client"] = client.hex()
    own.update((k, v) for k, v in fields.items() if v is not None)
    return {"fields": own}


def event_extra(name: LogEvent, fields: Mapping[str, Any]) -> dict[str, Any]:
    """``extra=`` for an event line: ``event`` = ``name`` and its ``fields`` (a
    mapping, so keys such as ``from`` can be used)."""
    return {"fields": {"event": name, **fields}}


def rfc3339(created: float) -> str:
    """A ``time.time()`` value as RFC 3339 UTC with milliseconds: 2026-12-02T00:54:57.123Z."""
    seconds = int(created)
    millis = int((created - seconds) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line (see the module doc).

    Args:
        role: this process's role: ``broker`` or a worker's id.
    """

    def __init__(self, role: str) -> None:
        super().__init__()
        self.role = role

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON (no newline; the handler adds it).
        Values JSON cannot hold are written as their ``str``."""
        line: dict[str, Any] = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process if record.process is not None else os.getpid(),
            "role": self.role,
        }
        own = getattr(record, "fields", None)
        if isinstance(own, Mapping):
            line.update((k, v) for k, v in own.items() if k not in BASE_KEYS)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        # UTF-8 as is, so `grep '"request_id":"ünï"'` finds it; json.dumps escapes
        # C0 controls, quotes and backslashes; _UNSAFE names the rest.
        text = json.dumps(line, default=str, separators=(",", ":"), ensure_ascii=False)
        return _UNSAFE.sub(_escape, text)


#: What ``json.dumps(ensure_ascii=False)`` leaves as is but a log line must not hold:
#: DEL and the C1 controls (U+0085 NEL breaks lines for ``str.splitlines``), the
#: line and paragraph separators U+2028/U+2029 (line breaks to ``splitlines`` and
#: to JavaScript), and lone surrogates (from a JSON ``"\ud800"``), which are not
#: UTF-8 at all. They only occur inside JSON strings, where ``\uXXXX`` is valid.
_UNSAFE = re.compile("[\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def configure(
    level: str,
    fmt: LogFormat,
    role: str,
    text_format: str = TEXT_FORMAT,
    stream: IO[str] | None = None,
) -> None:
    """Set up this process's root logger: ``level`` (debug, info, warning, error),
    text (``text_format``) or JSON lines (``fmt``), to ``stream`` (stderr).

    Replaces any handler the root logger had, so calling it again (a worker once
    its spec names it) changes the format rather than doubling every line. JSON
    lines are UTF-8 whatever the locale says (a Latin-1 locale or
    ``PYTHONIOENCODING=ascii`` would make ``ünï`` bytes or a ``\\xfc`` escape that
    no grep for the id finds): stderr is reconfigured to UTF-8 when it is the stream.
    """
    if fmt == "json" and stream is None and isinstance(sys.stderr, io.TextIOWrapper):
        sys.stderr.reconfigure(encoding="utf-8", errors="backslashreplace")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(role))
    else:
        handler.setFormatter(logging.Formatter(text_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level.upper())
