"""Command lines that run a module of this package in a fresh interpreter.

``python -m MODULE`` puts the current directory first on ``sys.path``: started
in a directory holding a ``broker.py`` or a ``fallback/``, the node and its
workers imported those instead of the installed package. These command lines
leave the current directory off ``sys.path`` (the working directory itself is
unchanged: relative config, model and rules paths still resolve against it) and
keep ``PYTHONPATH``.
"""

from __future__ import annotations

import sys
from pathlib import Path

#: Python < 3.11 has no ``-P``: run as ``python -c SAFE_PATH_BOOTSTRAP MODULE ARGS``,
#: it drops ``sys.path[0]`` (the current directory, put there by ``-c``) and runs
#: MODULE as ``-m`` would (``__main__``, ``sys.argv[0]`` the module's file).
SAFE_PATH_BOOTSTRAP = (
    "import runpy, sys; del sys.path[0]; del sys.argv[0]; "
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


def module_command(module: str, *args: str, safe_path_flag: bool | None = None) -> list[str]:
    """``sys.executable`` running ``module`` with ``args``, without the current
    directory on ``sys.path``: ``python -P -m MODULE ARGS`` (Python >= 3.11), or
    ``python -c SAFE_PATH_BOOTSTRAP MODULE ARGS``.

    ``safe_path_flag`` picks the form (default: ``-P`` where this interpreter has it).
    """
    if safe_path_flag is None:
        safe_path_flag = sys.version_info >= (3, 11)
    if safe_path_flag:
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", SAFE_PATH_BOOTSTRAP, module, *args]


def module_of_command(cmdline: list[str]) -> tuple[str, list[str]] | None:
    """The module a Python command line runs and the arguments after it, for
    ``python [-P] -m MODULE ARGS`` and ``module_command``'s forms; None for
    anything else."""
    if not cmdline or not Path(cmdline[0]).name.startswith("python"):
        return None
    args = cmdline[1:]
    if args[:1] == ["-P"]:
        args = args[1:]
    if len(args) >= 2 and args[0] == "-m":
        return args[1], args[2:]
    if len(args) >= 3 and args[:2] == ["-c", SAFE_PATH_BOOTSTRAP]:
        return args[2], args[3:]
    return None
