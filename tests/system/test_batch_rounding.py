"""``scripts/batch_rounding.py`` with the real model: it runs, and what a slot's
neighbours write never reaches its logits, bit for bit, even where the step's shape
changes its rounding (its rows first beside three neighbours: README "Workers and
slots"). The rounding itself depends on the CPU's kernels and is not asserted."""

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
