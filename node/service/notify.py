"""systemd's notify protocol (sd_notify(3)) in a few lines, without libsystemd.

A service of ``Type=notify`` gets ``$NOTIFY_SOCKET``: a datagram ``AF_UNIX``
socket of the service manager (a path, or an abstract name when it starts with
``@``). Each datagram is newline-separated ``KEY=VALUE`` assignments. The node
sends ``READY=1`` once it can serve, ``STATUS=<one line>`` when its state line
changes, ``WATCHDOG=1`` from the broker loop's turn and ``STOPPING=1`` when it
starts to stop.

The watchdog: systemd sets ``$WATCHDOG_USEC`` (and ``$WATCHDOG_PID``, the
process it expects the pings from) when the unit has ``WatchdogSec=``; a
service silent for that long is killed (``WatchdogSignal=``, SIGABRT) and, with
``Restart=on-failure``, restarted. sd_watchdog_enabled(3) recommends pinging at
half the timeout; so does ``Notifier.watchdog_due``.

Nothing here raises on a failed send: a service manager that went away or a
full socket must never take the broker down. The first failure is logged, the
next ones are not (a watchdog ping is sent every few seconds).
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

log = logging.getLogger("edgenode.node")

#: The environment systemd sets for the notify protocol; unset by
#: ``Notifier.from_environ`` so the workers (children) do not inherit it and
#: cannot speak for the node (sd_notify(3)'s ``unset_environment``).
ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
#: How long one send may block the loop when the manager's queue is full (s).
SEND_TIMEOUT_S = 0.5


def socket_address(value: str) -> str | None:
    """The ``AF_UNIX`` address of a ``$NOTIFY_SOCKET`` value: a path as given,
    ``@name`` as the abstract ``\\0name``; None for anything else (systemd also
    knows ``vsock:``, which the node does not speak)."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None


def watchdog_interval_s(environ: MutableMapping[str, str], pid: int) -> float | None:
    """The watchdog timeout in seconds, or None when no ping is expected from
    ``pid``: ``$WATCHDOG_USEC`` unset or not a positive integer (µs), or
    ``$WATCHDOG_PID`` set to another process (sd_watchdog_enabled(3))."""
    usec = environ.get("WATCHDOG_USEC", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    owner = environ.get("WATCHDOG_PID", "")
    if owner and (not owner.isdigit() or int(owner) != pid):
        return None
    return int(usec) / 1_000_000


class Notifier:
    """Sends notify messages to one socket; a no-op when there is none.

    Args:
        address: the ``AF_UNIX`` address (``socket_address``), or None (not
            under a service manager: every method does nothing).
        watchdog_s: the watchdog timeout (s), or None when no pings are expected.
    """

    def __init__(self, address: str | None, watchdog_s: float | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_s if address is not None else None
        self._sock: socket.socket | None = None
        self._failed = False
        self._ready = False
        self._status: str | None = None
        self._last_ping: float | None = None
        if address is not None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.settimeout(SEND_TIMEOUT_S)

    @classmethod
    def from_environ(cls, environ: MutableMapping[str, str] | None = None) -> Notifier:
        """The notifier ``$NOTIFY_SOCKET`` and ``$WATCHDOG_USEC``/``$WATCHDOG_PID``
        describe for this process; removes the three from ``environ`` (default
        ``os.environ``) so that children cannot notify in the node's name."""
        env = os.environ if environ is None else environ
        value = env.get("NOTIFY_SOCKET", "")
        address = socket_address(value)
        if value and address is None:
            log.warning("NOTIFY_SOCKET=%s is not a unix socket; not notifying", value)
        watchdog = watchdog_interval_s(env, os.getpid())
        for key in ENV_KEYS:
            env.pop(key, None)
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        """Whether a service manager listens."""
        return self._sock is not None

    @property
    def max_wait_s(self) -> float | None:
        """The longest the broker loop may sleep in one poll so that pings stay
        on time (a quarter of the timeout: a ping is then at most a quarter
        late after its half-timeout due time); None without a watchdog."""
        return None if self.watchdog_s is None else self.watchdog_s / 4

    def send(self, *assignments: str) -> bool:
        """Send one datagram of ``KEY=VALUE`` assignments; whether it went out."""
        if self._sock is None or self.address is None:
            return False
        try:
            self._sock.sendto("\n".join(assignments).encode(), self.address)
            return True
        except OSError as exc:
            if not self._failed:
                log.warning("systemd notify to %s failed: %s", self.address.lstrip("\0"), exc)
                self._failed = True
            return False

    def ready(self, status: str) -> None:
        """``READY=1`` once, with the state line unless that was the last one sent;
        later calls only update the line (``status``)."""
        if self._ready:
            self.status(status)
            return
        line = status.replace("\n", " ")
        # The line rides along only if it is news (it may have gone out just before).
        fields = ["READY=1"] if line == self._status else ["READY=1", f"STATUS={line}"]
        self._ready = self.send(*fields)
        if self._ready:
            self._status = line

    def status(self, line: str) -> None:
        """``STATUS=line`` when it differs from the last one sent."""
        line = line.replace("\n", " ")
        if line != self._status and self.send(f"STATUS={line}"):
            self._status = line

    def watchdog_due(self, now: float) -> bool:
        """Whether a ping is due at ``now`` (monotonic s): half the timeout since
        the last one, or none sent yet."""
        if self.watchdog_s is None:
            return False
        return self._last_ping is None or now - self._last_ping >= self.watchdog_s / 2

    def watchdog(self, now: float) -> None:
        """``WATCHDOG=1`` if due (``watchdog_due``)."""
        if self.watchdog_due(now) and self.send("WATCHDOG=1"):
            self._last_ping = now

    def stopping(self, status: str) -> None:
        """``STOPPING=1`` with the state line: the node has begun to stop."""
        if self.send("STOPPING=1", f"STATUS={status}"):
            self._status = status

    def close(self) -> None:
        """Close the socket; later sends do nothing."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
