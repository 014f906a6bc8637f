"""Loaded by every Python process of a server bench.vllm.rust starts (this folder on PYTHONPATH),
the same in both arms:

- the engine core's step times, with OTEL_LLM_BENCH_STEP_TIMES=<file>: when vLLM's engine-core
  module is first imported, ``EngineCore.step`` and ``EngineCore.step_with_batch_queue`` are
  wrapped (before any engine core is built, so its ``step_fn`` is the wrapper). Each call appends
  one :data:`RECORD` to the file (pid, which method, start on CLOCK_MONOTONIC, wall seconds, the
  calling thread's CPU seconds): one ``os.write`` on an O_APPEND descriptor;
- otel-llm's INFO lines on stderr (Python's last-resort handler shows warnings only), so that
  the server log says whether the plugin started its part.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import struct
import sys
import time
from types import ModuleType
from typing import Any, Callable, Optional, Sequence

PATH = os.environ.get("OTEL_LLM_BENCH_STEP_TIMES")
TARGET = "vllm.v1.engine.core"
RECORD = struct.Struct("=iBddd")  # pid, method (METHODS index), start, wall s, thread CPU s
METHODS = ("step", "step_with_batch_queue")


def _timed(method: Callable[..., Any], index: int, fd: list[int]) -> Callable[..., Any]:
    pack, monotonic, thread_time, write = RECORD.pack, time.monotonic, time.thread_time, os.write

    @functools.wraps(method)
    def timed(self: Any) -> Any:
        cpu0, start = thread_time(), monotonic()
        try:
            return method(self)
        finally:
            wall, cpu = monotonic() - start, thread_time() - cpu0
            if not fd:
                fd.append(os.open(str(PATH), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
            write(fd[0], pack(os.getpid(), index, start, wall, cpu))

    return timed


def _patch(module: ModuleType) -> None:
    core = module.EngineCore
    fd: list[int] = []  # the file's descriptor, opened at the first step
    for index, name in enumerate(METHODS):
        method = getattr(core, name, None)
        if method is not None:
            setattr(core, name, _timed(method, index, fd))


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Optional[Sequence[str]], target: Optional[ModuleType] = None
    ) -> Optional[importlib.machinery.ModuleSpec]:
        if name != TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            _patch(module)

        loader.exec_module = exec_and_patch
        return spec


def _log_info() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("(pid=%(process)d) %(levelname)s %(name)s: %(message)s"))
    logger = logging.getLogger("otel_llm")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


_log_info()
if PATH:
    sys.meta_path.insert(0, _Finder())
