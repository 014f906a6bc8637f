"""The heartbeat that the reliability tests use to tell a hook call that waited from a process
that was held back (tests/support/heartbeat.py): both cases, caused for real."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.support.heartbeat import Heartbeat

ROOT = Path(__file__).resolve().parents[2]


def test_a_call_that_waits_while_the_process_runs_is_a_wait():
    with Heartbeat() as heartbeat:
        start = time.perf_counter()
        threading.Event().wait(1.0)  # the wait being measured: a lock or a socket would do the same
        end = time.perf_counter()
        held = heartbeat.held_s(start, end)
    assert held < 0.5, held
    assert heartbeat.own_wait_s(start, end) > 0.5


# A process whose call spins until it is continued: the test stops it (SIGSTOP) for HOLD_S, as a
# loaded machine might; the call then took HOLD_S longer without waiting on anything.
CHILD = """
import json, signal, sys, time
from tests.support.heartbeat import Heartbeat

continued = False
def on_cont(signum, frame):
    global continued
    continued = True
signal.signal(signal.SIGCONT, on_cont)
with Heartbeat() as heartbeat:
    start = time.perf_counter()  # before the line: the test stops the process once it has read it
    print("spinning", flush=True)
    while not continued:
        pass
    end = time.perf_counter()
    print(json.dumps({"wall": end - start, "held": heartbeat.held_s(start, end)}), flush=True)
"""
HOLD_S = 1.0


def test_a_process_held_back_is_not_a_wait():
    child = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "spinning\n"
        child.send_signal(signal.SIGSTOP)
        time.sleep(HOLD_S)  # the stretch the process is held back, not a synchronisation
        child.send_signal(signal.SIGCONT)
        result = json.loads(child.stdout.readline())
        assert child.wait(timeout=30) == 0
    finally:
        child.kill()
        child.wait(timeout=30)
    # The heartbeat did not run while the process was stopped: that stretch is not the call's wait.
    assert HOLD_S - 0.1 < result["held"] <= result["wall"], result
