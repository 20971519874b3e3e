"""``module_command`` runs a module from ``PYTHONPATH`` and the installed
packages, never from the current directory, in both of its forms (``-P`` and the
bootstrap that stands in for it on Python 3.10), with the arguments ``-m`` gives."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from node.interpreter import module_command, module_of_command

PROBE = """\
import json, sys
print(json.dumps({"name": __name__, "file": __file__, "argv": sys.argv}))
"""


@pytest.mark.parametrize("safe_path_flag", [True, False], ids=["-P", "bootstrap"])
def test_the_module_comes_from_the_path_not_the_current_directory(
    tmp_path: Path, safe_path_flag: bool
) -> None:
    lib, cwd = tmp_path / "lib", tmp_path / "cwd"
    lib.mkdir()
    cwd.mkdir()
    (lib / "probe.py").write_text(PROBE)
    (cwd / "probe.py").write_text('raise SystemExit("probe.py of the cwd imported")\n')
    (cwd / "json.py").write_text('raise SystemExit("json.py of the cwd imported")\n')
    cmd = module_command("probe", "a", "--b", safe_path_flag=safe_path_flag)
    # An empty PYTHONPATH entry means the current directory: never add one.
    paths = [str(lib), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    assert seen == {"name": "__main__", "file": str(lib / "probe.py"), "argv": seen["argv"]}
    assert seen["argv"] == [str(lib / "probe.py"), "a", "--b"]
    assert module_of_command(cmd) == ("probe", ["a", "--b"])


@pytest.mark.parametrize(
    ("cmdline", "found"),
    [
        (["python3", "-m", "node.cli", "start"], ("node.cli", ["start"])),
        (["/v/bin/python", "-P", "-m", "node.worker"], ("node.worker", [])),
        (["python3", "-c", "print(1)", "node.cli", "start"], None),
        (["sleep", "-m", "node.cli"], None),
        ([], None),
    ],
)
def test_module_of_command(cmdline: list[str], found: tuple[str, list[str]] | None) -> None:
    assert module_of_command(cmdline) == found
