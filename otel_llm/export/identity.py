"""One identity per process: a ``service.instance.id`` that another live process on this host
already uses is reported.

Two processes exporting under one ``service.instance.id`` are one series to a collector, each
export overwriting the other's. The SDK gives every process its own UUID; an id set in
``OTEL_RESOURCE_ATTRIBUTES`` can repeat by mistake (the same environment for every replica).
A process with a user-given id holds an advisory lock named after it (a file per id in the
runtime directory) for its whole life; a second process that finds the lock taken logs one
warning naming the id and the other process. Other hosts cannot be seen from here.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional

_log = logging.getLogger(__name__)
_held: dict[str, int] = {}  # instance id -> open lock file descriptor, for the process's life
_checked: set[str] = set()  # every id looked at: one check (and at most one warning) each


def _lock_path(instance_id: str) -> Path:
    folder = Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / "otel-llm-instances"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / (hashlib.sha256(instance_id.encode()).hexdigest()[:32] + ".lock")


def claim(instance_id: str) -> Optional[int]:
    """Hold ``instance_id`` for this process. Returns the pid of another live process on this
    host that holds it (after one warning), else None. Never raises."""
    if not instance_id or instance_id in _checked:
        return None
    _checked.add(instance_id)
    try:
        fd = os.open(_lock_path(instance_id), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            _log.warning(
                "otel_llm: service.instance.id %r is already used by process %s on this host: a "
                "collector sees one series for both, each export overwriting the other's; give every "
                "process its own id (or leave it unset: each process then gets a UUID)",
                instance_id,
                other or "?",
            )
            return int(other) if other.isdigit() else -1
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _held[instance_id] = fd
    except OSError:
        _log.debug("otel_llm: could not check service.instance.id %r for reuse", instance_id, exc_info=True)
    return None


def _forget_after_fork() -> None:
    # A forked child has a new instance id (the SDK renews it); the parent's locks stay the parent's.
    _held.clear()
    _checked.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)
