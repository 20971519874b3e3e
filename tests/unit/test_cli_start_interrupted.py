"""A background start interrupted before it launches its node leaves no run directory
it made (break-it pass, session 18: `start & stop` at once left an empty one)."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import click
import pytest

from node.cli import main
from node.config import from_dict


@pytest.mark.parametrize("existed", [False, True], ids=["made", "there-before"])
def test_a_start_interrupted_before_its_node_removes_only_the_run_dir_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existed: bool
) -> None:
    run_dir = tmp_path / "run"
    if existed:
        run_dir.mkdir()
    config = from_dict({"node": {"run_dir": str(run_dir)}, "workers": {"engine": "test"}})

    def stopped_while_checking(_config: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # what `edgenode stop` sends a start
        time.sleep(5)  # the start's handler raises StartInterrupted first

    monkeypatch.setattr(main, "_check_startable", stopped_while_checking)
    with pytest.raises(click.ClickException, match="start interrupted \\(SIGTERM\\) before"):
        main._start_background(config, wait_s=5)
    assert run_dir.is_dir() == existed
