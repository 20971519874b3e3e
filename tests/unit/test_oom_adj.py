"""The model workers' OOM-killer preference (node.sandbox.oom) on fake and real /proc
files; the node's processes' own values are checked in tests/integration/test_skeleton.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from node.sandbox.oom import oom_score_adj, raise_oom_score_adj


def test_the_value_is_written_and_read_back(tmp_path: Path) -> None:
    knob = tmp_path / "42" / "oom_score_adj"
    knob.parent.mkdir()
    knob.write_text("0\n")
    assert raise_oom_score_adj(500, knob)
    assert knob.read_text() == "500\n"
    assert oom_score_adj(42, tmp_path) == 500
    assert oom_score_adj(43, tmp_path) is None  # no such process


def test_an_inherited_higher_value_is_not_lowered(tmp_path: Path) -> None:
    """A new user started the node from a shell at 700: the workers went down to 500,
    below the broker (root may lower it), the reverse of the point."""
    knob = tmp_path / "oom_score_adj"
    knob.write_text("700\n")
    assert not raise_oom_score_adj(500, knob)
    assert knob.read_text() == "700\n"


def test_a_refused_value_is_logged_and_the_worker_runs_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    assert not raise_oom_score_adj(500, tmp_path / "absent" / "oom_score_adj")
    assert "cannot read oom_score_adj" in caplog.text
    unwritable = tmp_path / "dir"
    unwritable.mkdir()
    (unwritable / "oom_score_adj").mkdir()  # reads and writes fail
    assert not raise_oom_score_adj(500, unwritable / "oom_score_adj")


def test_this_kernel_reports_a_process_value() -> None:
    value = oom_score_adj(os.getpid())
    assert value is not None and -1000 <= value <= 1000
