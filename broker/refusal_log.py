"""Which refused CURVE keys get a log line: a bound on what a flood of refused
handshakes writes to the node's log (which has no rotation: a flood must not
fill an edge device's disk).

Sans-I/O, time as an argument: ``broker.loop``'s ZAP handler asks ``refused``
for each key it refuses and logs what it is told; ``summary`` tells the loop,
once a window is over, how many refusals went unlogged. In one window (60 s)
at most ``FIRST_KEYS`` lines name a key (each key's first refusal in the
window), and one summary line follows: however many connections a flood
makes, the log grows by at most ``FIRST_KEYS + 1`` lines a minute. The refusal
counters (``Stats.refuse``, status ``refused``) count every attempt and are
not affected.
"""

from __future__ import annotations

#: Length of one window (s): a key refused again within it is not logged again.
WINDOW_S = 60.0
#: Keys named per window (each key's first refusal), however many distinct keys a
#: flood brings: with random keys every refusal would be a "first".
FIRST_KEYS = 10


class RefusalLog:
    """Per-window bookkeeping of refused keys (``log`` verdicts, no I/O).

    Args:
        window_s: the window length (s, monotonic clock).
        first_keys: how many distinct keys one window may name.
    """

    def __init__(self, window_s: float = WINDOW_S, first_keys: int = FIRST_KEYS) -> None:
        self.window_s = window_s
        self.first_keys = first_keys
        self._start: float | None = None
        #: Keys named in this window (at most ``first_keys``: memory is bounded too).
        self._named: set[bytes] = set()
        #: Refusals in this window, named or not.
        self._refusals = 0
        #: Refusals in this window that got no line of their own.
        self._unlogged = 0

    def refused(self, key: bytes, now: float) -> bool:
        """Note one refusal of ``key`` at ``now`` (s); True if it gets a line of its
        own (the key's first in this window, while fewer than ``first_keys`` were
        named). A window over is ended first: ask ``summary`` before, or its
        count of unlogged refusals is lost (``broker.loop.ZapHandler`` does)."""
        if self._start is None or now - self._start >= self.window_s:
            self._reset(now)
        self._refusals += 1
        if key in self._named or len(self._named) >= self.first_keys:
            self._unlogged += 1
            return False
        self._named.add(key)
        return True

    def summary(self, now: float) -> tuple[int, int] | None:
        """``(unlogged, refusals)`` of a window over at ``now`` (s) in which some
        refusals got no line, else None; a window over is ended either way."""
        if self._start is None or now - self._start < self.window_s:
            return None
        verdict = (self._unlogged, self._refusals) if self._unlogged else None
        self._start = None
        self._named.clear()
        self._refusals = self._unlogged = 0
        return verdict

    def _reset(self, now: float) -> None:
        self._start = now
        self._named.clear()
        self._refusals = self._unlogged = 0
