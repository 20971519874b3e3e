"""``scripts/batch_rounding.py`` with the real model: it runs, and what a slot's
neighbours write never reaches its logits, bit for bit. Whether the step's shape
changes the rounding depends on the CPU's kernels (on a Zen 4 only with repacked
weights: README "Workers and slots") and is not asserted."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from node.testing import REPO

pytestmark = [pytest.mark.system, pytest.mark.timeout(180)]


def test_neighbours_tokens_never_reach_a_slots_logits() -> None:
    script = REPO / "scripts" / "batch_rounding.py"
    done = subprocess.run(
        [sys.executable, str(script), "--tokens", "8", "--slot-first"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=170,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    cases = [line for line in done.stdout.splitlines() if line.startswith("  4 slots,")]
    assert len(cases) == 5, done.stdout
    other = cases[-1]
    assert "3 neighbours writing other tokens" in other
    assert other.endswith("against the first 3 neighbours' run: 0"), done.stdout


def test_a_prompt_longer_than_one_batch_is_refused_not_written_past_it() -> None:
    """A new user's 3,000-word prompt wrote past the script's 512-row batch (a NULL
    pointer stopped it one row later)."""
    script = REPO / "scripts" / "batch_rounding.py"
    done = subprocess.run(
        [sys.executable, str(script), "--prompt", " ".join(["word"] * 600)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=170,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert "error: --prompt: 601 tokens; at most 256" in done.stderr
