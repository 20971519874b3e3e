"""``etc/edgenode.service`` passes ``systemd-analyze verify``, and is the unit the
node's notify protocol needs (Type=notify, a watchdog, NotifyAccess=main)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from node.testing import REPO

UNIT = REPO / "etc" / "edgenode.service"
#: The script path the shipped unit names (README, "systemd").
SHIPPED = "/usr/local/bin/edgenode"


def settings(text: str) -> dict[str, list[str]]:
    """``Key=value`` lines of a unit (comments skipped); a key may repeat."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";")):
            key, value = line.split("=", 1)
            out.setdefault(key.strip(), []).append(value.strip())
    return out


def installed_edgenode() -> str | None:
    """This environment's ``edgenode`` script (the venv's, else one on PATH)."""
    beside = Path(sys.executable).parent / "edgenode"
    return str(beside) if beside.is_file() else shutil.which("edgenode")


def test_the_unit_is_a_notify_service_with_a_watchdog() -> None:
    unit = settings(UNIT.read_text())
    assert unit["Type"] == ["notify"]
    assert unit["NotifyAccess"] == ["main"]  # the node is the main process; not its workers
    (watchdog,) = unit["WatchdogSec"]
    assert int(watchdog) > 2  # pings every WatchdogSec/2 from a loop that turns each second
    assert unit["Restart"] == ["on-failure"]  # covers a watchdog timeout
    assert unit["ExecStart"] == [f"{SHIPPED} start --foreground"]
    assert unit["ExecStop"] == [f"{SHIPPED} stop"]


def test_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    script = installed_edgenode()
    if script is None:
        pytest.skip("no edgenode script installed (pip install .) for ExecStart=")
    # verify checks that ExecStart's program exists: point the copy at this
    # environment's script where /usr/local/bin/edgenode is not installed.
    copy = tmp_path / "edgenode.service"
    text = UNIT.read_text()
    if not Path(SHIPPED).is_file():
        text = text.replace(f"={SHIPPED} ", f"={script} ")
    copy.write_text(text)
    done = subprocess.run(
        [analyze, "verify", str(copy)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    # Warnings about this unit fail it too (verify exits 0 on some of them).
    ours = [line for line in done.stderr.splitlines() if "edgenode.service" in line]
    assert not ours, done.stderr
