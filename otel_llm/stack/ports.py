"""Loopback ports for the servers started locally: every listener binds 127.0.0.1."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the OS picks; tiny race until the user binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])
