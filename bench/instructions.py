"""Instructions executed by a process over a stretch of its run, counted by valgrind's callgrind:
the same work gives the same count whatever else the machine does, where CPU time on these
shared machines moves by 2x from one round to the next.

:func:`command` is the valgrind command line to run a Python program under, instrumentation off
(imports and set-up run at valgrind's uninstrumented speed); in that program, :class:`Window`
counts while it is entered (callgrind's client requests from valgrind/callgrind.h, built once
into a small library with the C compiler; outside valgrind they do nothing). Once the program
has exited, :func:`totals_by_thread` reads what was counted.

One stretch per process: callgrind dumps a thread's counts only from that thread, so counts
taken mid-run miss the other threads' (seen here: a thread's work counted in one round and not
the next); at the program's end it writes every thread's counts, each in a file of its own.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Optional

_SOURCE = r"""
#include <valgrind/callgrind.h>
int cg_running(void) { return RUNNING_ON_VALGRIND; }
void cg_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void cg_stop(void) { CALLGRIND_STOP_INSTRUMENTATION; }
"""
HEADER = Path("/usr/include/valgrind/callgrind.h")
OUT_NAME = "callgrind.out"


def missing() -> str:
    """Why instructions cannot be counted here ('' when they can)."""
    if shutil.which("valgrind") is None or not HEADER.exists():
        return "valgrind and its headers are needed (apt-get install valgrind)"
    if shutil.which("cc") is None:
        return "a C compiler (cc) is needed to build callgrind's client requests"
    return ""


def command(out_dir: Path) -> list[str]:
    """valgrind's command line, to be followed by the program and its arguments. String hashing
    is seeded alike in every process: with a random seed, dicts and sets of strings probe and
    order differently from run to run, and the same work counts differently (seen here: 7 M
    instructions apart on a scripted stream of 975 M; 7 thousand with a fixed seed)."""
    return [
        "env",
        "PYTHONHASHSEED=0",
        "valgrind",
        "--tool=callgrind",
        "--instr-atstart=no",
        "--separate-threads=yes",
        "--dump-line=no",
        f"--callgrind-out-file={out_dir / OUT_NAME}",
    ]


class Window:
    """``with Window():`` counts the instructions of every thread of this process meanwhile."""

    def __init__(self) -> None:
        build = Path(tempfile.mkdtemp(prefix="bench-callgrind-"))
        try:
            (build / "cg.c").write_text(_SOURCE)
            cc = ["cc", "-O1", "-shared", "-fPIC", "-o", str(build / "cg.so"), str(build / "cg.c")]
            subprocess.run(cc, check=True)
            self._lib = ctypes.CDLL(str(build / "cg.so"))
        finally:
            shutil.rmtree(build)

    def under_callgrind(self) -> bool:
        return bool(self._lib.cg_running())

    def __enter__(self) -> "Window":
        self._lib.cg_start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._lib.cg_stop()


def totals_by_thread(out_dir: Path, dump: Optional[int] = None) -> dict[int, int]:
    """Instructions counted by thread (valgrind's thread numbers: 1 is the main thread; a number
    is reused once its thread has ended, and then holds the counts of each thread that had it):
    those written at the program's end, or with ``dump`` those of the dump of that number
    (``callgrind_control -d``, which writes every thread's)."""
    counts: dict[int, int] = {}
    for path in out_dir.glob(f"{OUT_NAME}-*" if dump is None else f"{OUT_NAME}.{dump}-*"):
        thread = totals = None
        with path.open() as f:
            for line in f:
                if line.startswith("thread:"):
                    thread = int(line.split()[1])
                elif line.startswith("totals:"):
                    totals = int(line.split()[1])
        if thread is None or totals is None:
            raise RuntimeError(f"{path}: no thread or totals line")
        counts[thread] = counts.get(thread, 0) + totals
    if not counts:
        raise RuntimeError(f"no callgrind output in {out_dir}")
    return counts
