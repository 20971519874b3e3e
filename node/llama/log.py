"""llama.cpp's and ggml's log, bridged to the worker's stderr at a chosen level.

Part of the llama.cpp engine adapter (``node.llama.engine``): with it, the only
modules that import ``llama_cpp``.
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
from collections.abc import Iterator

import llama_cpp

#: ggml_log_level (ggml/include/ggml.h). llama-cpp-python 0.3.x's own callback
#: (llama_cpp/_logger.py) still maps an older enum (1 INFO, 2 WARN, 3 ERROR,
#: 4 DEBUG): with ``verbose=False`` it printed warnings and dropped errors.
LOG_NONE, LOG_DEBUG, LOG_INFO, LOG_WARN, LOG_ERROR, LOG_CONT = range(6)


class LlamaLog:
    """llama.cpp's and ggml's log callback: messages at ``level`` or above go to stderr.

    A continuation (``LOG_CONT``) follows its message's fate; ``LOG_NONE`` (plain
    output, e.g. performance prints) is always shown, as ggml's default logger does.
    """

    def __init__(self) -> None:
        self.level = LOG_WARN
        self._shown = False
        self._captured: list[str] | None = None
        # Keep a reference: ctypes frees the trampoline when the object dies.
        self._callback = llama_cpp.llama_log_callback(self._write)
        llama_cpp.llama_log_set(self._callback, ctypes.c_void_p())

    def _write(self, level: int, text: bytes, _data: ctypes.c_void_p) -> None:
        if level != LOG_CONT:
            self._shown = level == LOG_NONE or level >= self.level
        if self._captured is not None:
            self._captured.append(text.decode("utf-8", "replace"))
        if self._shown:
            sys.stderr.write(text.decode("utf-8", "replace"))
            sys.stderr.flush()

    @contextlib.contextmanager
    def at_level(self, level: int) -> Iterator[None]:
        """Show only messages at ``level`` or above meanwhile (e.g. ``LOG_ERROR``)."""
        saved, self.level = self.level, level
        try:
            yield
        finally:
            self.level = saved

    @contextlib.contextmanager
    def capture(self) -> Iterator[list[str]]:
        """Also collect every message, at any level, meanwhile."""
        captured: list[str] = []
        self._captured = captured
        try:
            yield captured
        finally:
            self._captured = None


#: The process's one bridge (llama.cpp has one log callback per process).
LLAMA_LOG = LlamaLog()

#: A level above every ggml level: only ``LOG_NONE`` output is shown meanwhile.
LOG_QUIET = LOG_CONT + 1
