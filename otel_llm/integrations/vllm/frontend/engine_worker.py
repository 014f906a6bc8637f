"""``python -m otel_llm.integrations.vllm.frontend.engine_worker FOLDER LISTENER CONTROL ENGINE
INSTANCE_ID``: one engine core's stream recorded in a process of its own, started by ``vllm serve``'s
process (:mod:`.engine_workers`) when the serve has several local engines, so that the recording
scales with them instead of sharing one thread (and one GIL) among all.

It runs the serve's consumer code (:class:`.StreamConsumer`) on that engine's socket (``LISTENER``,
an inherited descriptor the serve bound before the engine core started), with that engine's
telemetry as the serve would build it (``service.instance.id``: the serve's ``INSTANCE_ID``,
``-engine-N``): its OTLP pushed from here, the cause channel read as one more receiver. Its
Prometheus families are kept in a registry of its own and handed to the serve's one endpoint on
each scrape over ``CONTROL`` (a socket pair with the serve): a request ``>cI`` (:data:`COLLECT`,
:data:`STOPPING` or :data:`CLOSE`, a sequence number), a reply ``>II`` (the sequence number, a
length) then the families, pickled (for :data:`STOPPING`, True once its consumer knows).

It ignores SIGINT and SIGTERM (the serve tells it when to end, after a signal to the serve's
group); it ends when the serve says so, or closes its end, or dies: its requests in flight end
``shutdown``, everything is flushed.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
from typing import Any, Optional, Sequence

COLLECT, STOPPING, CLOSE = b"C", b"S", b"Q"
REQUEST = struct.Struct(">cI")
REPLY = struct.Struct(">II")
PARENT_POLL_S = 0.5  # how often it looks whether the serve still runs, while asked nothing

_log = logging.getLogger("otel_llm.integrations.vllm")


def main(argv: Optional[Sequence[str]] = None) -> int:
    folder, listener_fd, control_fd, engine, instance_id = argv if argv is not None else sys.argv[1:]
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    parent = os.getppid()
    logging.basicConfig(
        level=logging.WARNING, format=f"(otel-llm engine {engine} pid={os.getpid()}) %(levelname)s %(message)s"
    )
    listener = socket.socket(fileno=int(listener_fd))
    control = socket.socket(fileno=int(control_fd))

    from otel_llm.export.prometheus import PrometheusEndpoint
    from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer, freeze_start_up_heap

    endpoint = PrometheusEndpoint(port=0)  # never served: the serve's endpoint asks it for its families
    consumer = StreamConsumer(folder, listener=listener, serve_on=endpoint, instance_id=instance_id).start()
    try:
        consumer.warm()
    except Exception as exc:  # noqa: BLE001 - decoding is set up at the first outputs instead
        _log.warning("otel-llm: loading vLLM's output classes failed (%r); tried again at the first outputs", exc)
    freeze_start_up_heap()  # vLLM's classes just loaded: frozen now, not at the first hello under load
    try:
        serve(control, endpoint.registry, consumer, parent)
    finally:
        consumer.close()
        endpoint.shutdown()
    return 0


def serve(control: socket.socket, registry: Any, consumer: Any, parent: int) -> None:
    """Answer the serve's requests until it says to end, closes its end, or is gone."""
    pending = b""
    while os.getppid() == parent:
        ready, _, _ = select.select([control], [], [], PARENT_POLL_S)
        if not ready:
            continue
        try:
            chunk = control.recv(1 << 12)
        except OSError:
            return
        if not chunk:
            return
        pending += chunk
        while len(pending) >= REQUEST.size:
            kind, seq = REQUEST.unpack_from(pending)
            pending = pending[REQUEST.size :]
            if kind == CLOSE:
                return
            if kind in (COLLECT, STOPPING):
                if kind == STOPPING:
                    consumer.serve_stopping()
                answer = list(registry.collect()) if kind == COLLECT else True
                payload = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    control.sendall(REPLY.pack(seq, len(payload)) + payload)
                except OSError:
                    return


if __name__ == "__main__":
    sys.exit(main())
