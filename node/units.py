"""Units an operator writes in the config: memory sizes and CPU amounts.

Sizes are binary (base 1024), as the kernel and systemd read them
(``MemoryMax=1G`` is 1 GiB): ``"512K"``, ``"256M"``, ``"1.5G"``, ``"8G"``, or a
plain number of bytes (``"4096"`` or the integer ``4096``). A trailing ``B``,
``iB`` or ``i`` is accepted (``"8GiB"`` = ``"8G"``).

CPU amounts are in cores: ``0.5`` is half a core, ``2`` two cores, ``"max"`` no
quota. They become a CFS bandwidth quota per period (Documentation/scheduler/
sched-bwc.rst; cgroup-v2.rst ``cpu.max``).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIX = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGTP]?)(?:I?B|I)?\s*$", re.IGNORECASE)

#: The kernel refuses CFS quotas below 1 ms (sched-bwc.rst), in µs.
MIN_QUOTA_US = 1000
#: The default CFS period, 100 ms, in µs (sched-bwc.rst; cgroup-v2.rst ``cpu.max``).
DEFAULT_PERIOD_US = 100_000


def parse_size(text: str | int) -> int:
    """A size in bytes from ``"8G"``, ``"256M"``, ``"1.5G"``, ``"512K"``, ``"4096"`` or ``4096``.

    Fractions are rounded down to whole bytes.

    Raises:
        ValueError: not a non-negative size; the message quotes the text.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a size cannot be negative: {text}")
        return text
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 4096, 512K, 256M, 1.5G)")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"not a size: {text!r}") from exc
    return int(number * 1024 ** _SUFFIX[match.group(2).upper()])


def format_size(size: int) -> str:
    """A size for messages: ``format_size(3 * 2**29) == "1.5 GiB"``, ``"512 B"``."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            text = f"{value:.1f}".rstrip("0").rstrip(".") if unit != "B" else str(size)
            return f"{text} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def parse_cores(value: str | float) -> float | None:
    """A CPU amount in cores from ``0.5``, ``2``, ``"1.5"`` or ``"max"`` (None = no quota).

    Raises:
        ValueError: not ``"max"`` and not a positive number.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a CPU amount: {value!r}")
    if isinstance(value, str):
        if value.strip().lower() == "max":
            return None
        try:
            value = float(value)
        except ValueError as exc:
            raise ValueError(f'not a CPU amount: {value!r} (a number of cores or "max")') from exc
    cores = float(value)
    if not cores > 0:  # also refuses NaN
        raise ValueError(f"a CPU quota must be more than 0 cores, got {value!r}")
    return cores


def quota_us(cores: float | None, period_us: int = DEFAULT_PERIOD_US) -> int | None:
    """The CFS quota for ``cores`` per ``period_us`` (µs), at least 1 ms; None = no quota."""
    if cores is None:
        return None
    return max(MIN_QUOTA_US, round(cores * period_us))
