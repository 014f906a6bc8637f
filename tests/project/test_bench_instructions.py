"""bench.instructions, the instruction counts behind ``bench.vllm.frontend --instructions``: a
window counts every thread's work in it, a thread that ended before the window did included,
and nothing outside it; the same work counts the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench import instructions
from tests.support.backends import require_backend

ROOT = Path(__file__).resolve().parents[2]

# Fixed work in the main thread and in two threads that end inside the window; more of it
# outside, before and after.
PROGRAM = """
import sys, threading
from bench.instructions import Window

n, outside = int(sys.argv[1]), 4 * int(sys.argv[1])
window = Window()
assert window.under_callgrind()
sum(range(outside))
with window:
    sum(range(n))
    for _ in range(2):
        t = threading.Thread(target=lambda: sum(range(n)))
        t.start()
        t.join()
sum(range(outside))
"""


def _count(tmp_path: Path, n: int) -> dict[int, int]:
    out = tmp_path / str(n)
    out.mkdir()
    proc = subprocess.run(
        [*instructions.command(out), sys.executable, "-c", PROGRAM, str(n)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return instructions.totals_by_thread(out)


def test_a_window_counts_every_threads_work_in_it_and_the_same_work_the_same(tmp_path: Path) -> None:
    reason = instructions.missing()
    if reason:
        require_backend("valgrind", reason)
    once, again, twice = _count(tmp_path, 100_000), _count(tmp_path, 100_001), _count(tmp_path, 200_000)
    for counts in (once, again, twice):
        assert counts[1] > 0 and sum(v for k, v in counts.items() if k != 1) > 0, counts
    # The threads did twice the main thread's work: their counts say so (interpreter overhead aside).
    threads = sum(v for k, v in once.items() if k != 1)
    assert threads == pytest.approx(2 * once[1], rel=0.1)
    assert sum(again.values()) == pytest.approx(sum(once.values()), rel=0.005)
    # Twice the work in the window, the same outside: twice the count (the outside is not counted).
    assert sum(twice.values()) == pytest.approx(2 * sum(once.values()), rel=0.03)
