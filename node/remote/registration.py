"""How a host agent learns that the gateway's broker registered its workers.

A node hears READY itself (its broker registers the worker); a host agent runs no
broker, and the gateway tells it nothing. What the gateway already sends is enough:
its broker sends a worker HEARTBEAT, REQUEST, CANCEL or CREDIT only once it
registered that worker's READY (an unregistered one hears only DISCONNECT,
PROTOCOL §13.4, §13.6). So a worker started by an agent notes, at the first such
message on each connection, that it is registered: the agent sets
``REGISTERED_DIR_ENV`` in its workers' environment, and each worker keeps one small
file there, ``<worker_id>``, holding ``"<pid> <registrations>\\n"`` (how many times
this process has been registered, re-registrations after a lost link included).
The agent reads it every tick (``read_note``). Workers of a node, without the
variable, write nothing.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

log = logging.getLogger("edgenode.worker")

#: The environment variable naming the directory of the registration notes (set by
#: ``node.remote.agent`` for its workers only).
REGISTERED_DIR_ENV = "EDGENODE_REGISTERED_DIR"


class RegistrationNote:
    """A worker's side: note the first broker message of each connection.

    Args:
        worker_id: the worker's id, the note's file name.
        directory: where to write it; None: write nothing (a node's own worker).
    """

    def __init__(self, worker_id: str, directory: str | None) -> None:
        self.path = Path(directory) / worker_id if directory else None
        self.registrations = 0
        self._noted = False

    @classmethod
    def from_env(cls, worker_id: str) -> RegistrationNote:
        """The note of ``worker_id`` in ``$EDGENODE_REGISTERED_DIR`` (none if unset)."""
        return cls(worker_id, os.environ.get(REGISTERED_DIR_ENV) or None)

    def connected(self) -> None:
        """A new connection (and identity): not registered on it until the broker says
        something other than DISCONNECT."""
        self._noted = False

    def heard(self) -> None:
        """The broker sent this connection a HEARTBEAT, REQUEST, CANCEL or CREDIT: it
        registered the worker. The first time per connection, the note is written
        (aside, then renamed: a reader never sees half of it). A failed write is
        logged; the worker serves on."""
        if self._noted or self.path is None:
            return
        self._noted = True
        self.registrations += 1
        aside = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        try:
            aside.write_text(f"{os.getpid()} {self.registrations}\n")
            os.replace(aside, self.path)
        except OSError as exc:
            log.warning("cannot note the registration in %s: %s", self.path, exc)
            with contextlib.suppress(OSError):
                aside.unlink()


def read_note(directory: Path, worker_id: str) -> tuple[int, int] | None:
    """``(pid, registrations)`` of ``worker_id``'s note in ``directory``, or None
    (none yet, or unreadable)."""
    try:
        pid, count = (directory / worker_id).read_text().split()
        return int(pid), int(count)
    except (OSError, ValueError):
        return None
