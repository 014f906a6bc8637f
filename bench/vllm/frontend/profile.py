"""A profile by function: py-spy (another process, the GIL not needed to sample), per thread."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from . import ROOT

SCRIPT = "otel_llm/testing/vllm/stream.py"


class Profile:
    """``py-spy record`` of this process for the duration (every thread's Python stack, idle
    threads left out); :meth:`report` counts, for the event loop's thread (``MainThread``, where
    this runs the loop) and for the others apart, the functions on the stack (inclusive) and the
    innermost one (self), and the share of samples in the plugin, in vLLM's stat loggers and in
    the OpenTelemetry SDK."""

    AREAS = {
        "plugin": ("otel_llm/",),
        "vllm_stat_loggers": ("vllm/v1/metrics/loggers.py",),
        "opentelemetry": ("opentelemetry/",),
        "prometheus_client": ("prometheus_client/",),
    }

    def __init__(self, rate: int = 1000) -> None:
        self.rate = rate
        self.path = Path(tempfile.mkstemp(prefix="bench-py-spy-", suffix=".txt")[1])
        self.lines: list[str] = []  # folded stacks of every round profiled
        self._proc: Optional[subprocess.Popen] = None

    def __enter__(self) -> "Profile":
        spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        self._proc = subprocess.Popen(
            [
                spy,
                "record",
                "--pid",
                str(os.getpid()),
                "--rate",
                str(self.rate),
                "--format",
                "raw",
                "--threads",
                "--full-filenames",
                "--nonblocking",
                "-o",
                str(self.path),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._proc is not None
        self._proc.send_signal(signal.SIGINT)
        self._proc.wait(timeout=60)
        self.lines += self.path.read_text().splitlines()

    def report(self, top: int = 20) -> dict[str, Any]:
        groups = ("loop", "others")
        counts: dict[str, collections.Counter[str]] = {g: collections.Counter() for g in groups}
        self_counts: dict[str, collections.Counter[str]] = {g: collections.Counter() for g in groups}
        areas: dict[str, collections.Counter[str]] = {g: collections.Counter() for g in groups}
        samples: collections.Counter[str] = collections.Counter()
        for line in self.lines:
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            if len(frames) < 2 or not n.isdigit():
                continue
            group = "loop" if frames[0].endswith(": MainThread") else "others"
            names = [_function(f) for f in frames[1:]]
            samples[group] += int(n)
            self_counts[group][names[-1]] += int(n)
            for name in set(names):
                counts[group][name] += int(n)
            for area, markers in self.AREAS.items():
                # The scripted core is the bench's, not the plugin's.
                if any(m in f and SCRIPT not in f for f in frames[1:] for m in markers):
                    areas[group][area] += int(n)
        self.path.unlink(missing_ok=True)
        out: dict[str, Any] = {}
        for g in ("loop", "others"):
            total = samples[g] or 1
            out[g] = {
                "samples": samples[g],
                "area_share": {a: round(areas[g][a] / total, 4) for a in self.AREAS},
                "inclusive_share": {k: round(v / total, 4) for k, v in counts[g].most_common(top)},
                # The plugin's and vLLM's stat-logging functions alone (the scripted core left out).
                "stat_logging_inclusive_share": {
                    k: round(v / total, 4)
                    for k, v in [
                        (k, v)
                        for k, v in counts[g].most_common()
                        if k.startswith(("otel_llm.", "vllm.v1.metrics.")) and not k.startswith("otel_llm.testing.")
                    ][:30]
                },
                "self_share": {k: round(v / total, 4) for k, v in self_counts[g].most_common(top)},
            }
        return out


def _function(frame: str) -> str:
    """``name (path/to/module.py:12)`` -> ``module.path:name``."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    for marker in ("site-packages/", f"{ROOT}/", "lib/python3.11/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{path.removesuffix('.py').replace('/', '.')}:{name}"
