"""Servers that die with the process that started them, however it ends."""

from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """A ``preexec_fn``: the child gets SIGKILL when its parent dies (Linux), so a parent killed
    before it could stop its servers leaves none behind."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
