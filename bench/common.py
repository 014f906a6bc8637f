"""Shared helpers: interleaved repetitions, medians, RSS, a local OTLP receiver (rotel)."""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from otel_llm.stack.ports import LOOPBACK, free_port


def median(values: list[float]) -> float:
    return float(statistics.median(values)) if values else math.nan


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def interleave(variants: dict[str, Callable[[], float]], reps: int, rotate: bool = True) -> dict[str, list[float]]:
    """Run each variant once per repetition, in turn (ABCABC..., the order rotated every repetition
    so that no variant always runs first after a GC or a frequency change). Each callable returns
    one measurement; returns every measurement per variant."""
    names = list(variants)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(reps):
        order = names[r % len(names) :] + names[: r % len(names)] if rotate else names
        for name in order:
            gc.collect()
            out[name].append(variants[name]())
    return out


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS in /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    n = len(xs)
    if n < 2:
        return math.nan
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else math.nan


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((LOOPBACK, port), timeout=0.2):
            return True
    except OSError:
        return False


def rotel_binary() -> Optional[str]:
    try:
        import rotel  # noqa: F401 - only to locate the package
    except ImportError:
        return None
    module_file = sys.modules["rotel"].__file__
    if module_file is None:
        return None
    path = Path(module_file).parent / "rotel-agent"
    return str(path) if path.exists() else None


@contextlib.contextmanager
def otlp_receiver() -> Iterator[dict[str, Any]]:
    """A real OTLP receiver on free loopback ports: rotel-agent, a subprocess (blackhole exporter),
    so the receiving side does not share this process's GIL.

    Yields {"kind", "grpc": "http://127.0.0.1:P", "http": "http://127.0.0.1:Q"}.
    """
    binary = rotel_binary()
    if binary is not None:
        workdir = Path(tempfile.mkdtemp(prefix="otel-llm-bench-rotel-"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("ROTEL_", "OTEL_"))}
        proc = None
        try:
            with open(workdir / "out.log", "wb") as out:
                for _ in range(3):
                    grpc_port, http_port = free_port(), free_port()
                    if grpc_port == http_port:
                        continue
                    proc = subprocess.Popen(
                        [
                            binary,
                            "start",
                            f"--otlp-grpc-endpoint={LOOPBACK}:{grpc_port}",
                            f"--otlp-http-endpoint={LOOPBACK}:{http_port}",
                            f"--pid-file={workdir / 'rotel.pid'}",
                            f"--log-file={workdir / 'rotel.log'}",
                            "--exporter=blackhole",
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        cwd=workdir,
                        env=env,
                    )
                    deadline = time.monotonic() + 15
                    while time.monotonic() < deadline and proc.poll() is None:
                        if _port_open(grpc_port) and _port_open(http_port):
                            break
                        time.sleep(0.05)
                    if proc.poll() is None and _port_open(grpc_port):
                        break
                    _stop(proc)
                    proc = None
                if proc is not None:
                    yield {
                        "kind": "rotel-agent (subprocess, blackhole exporter)",
                        "grpc": f"http://{LOOPBACK}:{grpc_port}",
                        "http": f"http://{LOOPBACK}:{http_port}",
                    }
                    return
        finally:
            if proc is not None:
                _stop(proc)
            shutil.rmtree(workdir, ignore_errors=True)
    raise RuntimeError("no OTLP receiver: rotel-agent not found or did not start (pip install rotel)")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


@contextlib.contextmanager
def env(**values: Optional[str]) -> Iterator[None]:
    """Set (or unset, with None) environment variables for the duration."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        for k, v in values.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def flush(sub: Any) -> None:
    """Apply event batches a subscriber still keeps (EngineTelemetry defers them a few steps)."""
    apply = getattr(getattr(sub, "telemetry", sub), "flush", None)
    if apply is not None:
        apply()


def write_section(key: str, out: Path, run: Callable[[], dict[str, Any]], table: Callable[[dict], list[str]]) -> int:
    """A section run by its own command: run it, timed, put it under ``key`` in ``out`` (other
    keys kept), print its table."""
    t0 = time.perf_counter()
    result = run()
    result["seconds"] = round(time.perf_counter() - t0, 1)
    results = json.loads(out.read_text()) if out.exists() else {}
    results[key] = result
    out.write_text(json.dumps(results, indent=1) + "\n")
    print("\n".join(table(result)))
    print(f"\nwrote {key} into {out}")
    return 0
