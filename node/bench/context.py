"""What every scenario is given: the run's options and its progress bar."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, TypeVar

#: The engine of the node in the model-dependent scenarios: ``llama`` (the default
#: model) for real figures, ``test`` (deterministic, node.engine.TestEngine) to check the
#: machinery quickly.
BenchEngine = Literal["test", "llama"]
T = TypeVar("T")


class Progress(Protocol):
    """The part of a tqdm bar the scenarios use."""

    def update(self, n: float | None = 1) -> bool | None: ...

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None: ...


class NoProgress:
    """A progress bar that shows nothing (before the real one exists, or in tests)."""

    def update(self, n: float | None = 1) -> bool | None:
        """Nothing to count."""
        return None

    def set_postfix_str(self, s: str = "", refresh: bool = True) -> None:
        """Nothing to show."""


@dataclass
class BenchContext:
    """The options of one ``edgenode bench`` run.

    ``quick``: about a 2-minute run (fewer and shorter measurements); ``engine``: see
    ``BenchEngine``; ``llama_server``: a llama-server binary for the baselines that need
    one (None: those rows are left out); ``bar``: the run's progress bar, one unit per step.
    """

    quick: bool
    engine: BenchEngine
    llama_server: Path | None
    bar: Progress

    def step(self, label: str) -> None:
        """Count one more step and show ``label``, what runs now (the bar reaches its total
        as the last step starts; the report is written after it)."""
        self.bar.set_postfix_str(label)
        self.bar.update(1)

    def pick(self, quick: T, full: T) -> T:
        """``quick`` in a quick run, ``full`` otherwise."""
        return quick if self.quick else full


def split_list(text: str, what: str = "name") -> list[str]:
    """A comma-separated option (``"a, b"``) as its items, spaces stripped.

    Raises:
        ValueError: the list is empty or blank, or has an empty item (``"a,"``, ``"a,,b"``):
            a typo there would otherwise widen or narrow the run silently.
    """
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ValueError(f"no {what} given")
    if "" in items:
        raise ValueError(f"an empty {what} in {text!r} (a stray comma?)")
    return items


def list_type(what: str, item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse ``type=`` for a comma-separated option of the bench scripts: ``split_list``,
    then ``item`` on each (e.g. ``int``).

    The returned function raises argparse.ArgumentTypeError (argparse prints it and exits 2)
    for what ``split_list`` refuses or ``item`` cannot convert.
    """

    def parse(text: str) -> list[T]:
        try:
            return [item(x) for x in split_list(text, what)]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    return parse
