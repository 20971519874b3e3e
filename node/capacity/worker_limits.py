"""A model worker's cgroup memory limits, from ``[workers] memory_max`` and ``memory_high``.

``memory_max`` is a size ("768M", integer bytes), "max" (no limit) or "auto". "auto"
means the capacity plan's per-worker ``memory.max`` (``node.capacity.plan.Plan.memory_max``:
the worker's estimate, its slots' KV (``workers.slots`` x KV per sequence), runtime and
grammar, plus ``capacity.safety_margin``). The
node computes it at start from the same plan ``edgenode capacity`` prints, so the two
agree. ``memory_high`` "" follows ``memory_max``: 90 % of a size, or with "auto" the
plan's ``memory.high`` (estimate + half the margin). 90 % of the plan's ``memory.max``
would be 99 % of the estimate: a worker at its planned peak would already be over it.

The sandbox (``limits_for``), the capacity check (``check_fits``), the node's default
pressure budget, ``status`` and ``edgenode capacity`` all read the limits through
``memory_max_bytes`` and ``memory_high_bytes``.
"""

from __future__ import annotations

from typing import Protocol

from broker.errors import ConfigError
from node.units import format_size, parse_size

AUTO = "auto"
#: The smallest per-worker memory.max accepted (bytes): below it an interpreter cannot start.
MIN_MEMORY_MAX = 16 * 1024 * 1024


class MemorySettings(Protocol):
    """The ``[workers]`` keys read here, as ``node.config.WorkersSection`` holds them
    (a protocol: the config calls ``validate_memory`` while it loads)."""

    @property
    def memory_max(self) -> str | int: ...

    @property
    def memory_high(self) -> str | int: ...


class PlannedLimits(Protocol):
    """What "auto" reads from the capacity plan (``node.capacity.plan.Plan``), in bytes."""

    @property
    def memory_max(self) -> int: ...

    @property
    def memory_high(self) -> int: ...


def is_auto(w: MemorySettings) -> bool:
    """Whether ``workers.memory_max`` is "auto" (any case, spaces around allowed)."""
    return isinstance(w.memory_max, str) and w.memory_max.strip().lower() == AUTO


def memory_max_bytes(w: MemorySettings, plan: PlannedLimits | None = None) -> int | None:
    """A worker's ``memory.max`` in bytes; None = "max" (no limit).

    "auto" is ``plan.memory_max``: the capacity plan's, computed at start.

    Raises:
        ConfigError: not a size, "max" or "auto"; or "auto" without a plan.
    """
    if is_auto(w):
        if plan is None:
            raise ConfigError(
                'workers.memory_max = "auto" is the capacity plan\'s memory.max, and there is '
                "no plan here"
            )
        return plan.memory_max
    return _size_or_max("workers.memory_max", w.memory_max, ', "max" or "auto"')


def memory_high_bytes(w: MemorySettings, plan: PlannedLimits | None = None) -> int | None:
    """A worker's high watermark in bytes; None = "max" (none).

    ``workers.memory_high`` "" is 90 % of ``memory_max``, or ``plan.memory_high``
    when ``memory_max`` is "auto"; "max" is none; else a size.

    Raises:
        ConfigError: not a size or "max"; or "" with "auto" and no plan.
    """
    if w.memory_high == "":
        if is_auto(w):
            if plan is None:
                raise ConfigError(
                    'workers.memory_high = "" with memory_max = "auto" is the capacity '
                    "plan's memory.high, and there is no plan here"
                )
            return plan.memory_high
        limit = memory_max_bytes(w)
        return None if limit is None else limit * 9 // 10
    return _size_or_max("workers.memory_high", w.memory_high, ' or "max"')


def validate_memory(w: MemorySettings) -> None:
    """What can be checked before there is a plan: the values' syntax; with a size, the
    minimum and ``memory_high`` <= ``memory_max``. With "auto", ``node.capacity.plan.check_fits``
    checks ``memory_high`` against the plan at start.

    Raises:
        ConfigError: the first problem, naming the key.
    """
    if w.memory_high != "":
        memory_high_bytes(w)
    if is_auto(w):
        return
    limit, high = memory_max_bytes(w), memory_high_bytes(w)
    if limit is not None and limit < MIN_MEMORY_MAX:
        raise ConfigError(
            f"workers.memory_max = {w.memory_max!r} is below {format_size(MIN_MEMORY_MAX)}: "
            "a worker cannot even start in that"
        )
    if limit is not None and high is not None and high > limit:
        raise ConfigError(
            f"workers.memory_high ({w.memory_high!r}) must not exceed workers.memory_max "
            f"({w.memory_max!r})"
        )


def describe(w: MemorySettings, plan: PlannedLimits | None = None) -> dict[str, str | int | None]:
    """For ``status`` and ``edgenode capacity``: the setting and the limits it gives (bytes)."""
    return {
        "setting": str(w.memory_max),
        "memory_max": memory_max_bytes(w, plan),
        "memory_high": memory_high_bytes(w, plan),
    }


def _size_or_max(key: str, value: str | int, choices: str) -> int | None:
    if isinstance(value, str) and value.strip().lower() == "max":
        return None
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}; give a size{choices}") from exc
