"""vLLM frontends that call no stat-logger plugin: the Rust frontend (``VLLM_USE_RUST_FRONTEND=1``)
serves the OpenAI API from a Rust binary in place of vLLM's Python API server, and never builds
the plugin's stat logger (vLLM issue #58313).

There otel-llm records from the engine core's stream instead (:func:`start`, run by the plugin's
``vllm.general_plugins`` entry point in every vLLM process): ``vllm serve``'s own process, which
makes the serve's channel folder and outlives its engine cores, runs the telemetry
(:mod:`.stream_consumer`; with several local engines, each after the first in a process of its own:
:mod:`.engine_workers`); the processes it starts (the engine cores)
hand their stream over (:mod:`.engine_tap`). The user's settings are the Python frontend's: the
``OTEL_*`` variables, ``OTEL_LLM_*``, the deep hook for the preemptions' causes (on unless
``OTEL_LLM_VLLM_DEEP_HOOK=0``).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

from otel_llm.integrations.vllm.channels.cause_channel import ENV, folder, maker_alive

_log = logging.getLogger(__name__)

RUST_FRONTEND_ENV = "VLLM_USE_RUST_FRONTEND"
_started: list[Any] = []  # this process's part, once: the consumer, or the engine core's tap module


def rust_frontend(environ: Mapping[str, str] = os.environ) -> bool:
    """The Rust frontend is asked for, by vLLM's own rule (``bool(int(value))``); a value that is
    not a number is vLLM's to reject."""
    try:
        return bool(int(environ.get(RUST_FRONTEND_ENV, "0")))
    except ValueError:
        return False


def start(environ: Mapping[str, str] = os.environ) -> bool:
    """Under the Rust frontend, this process's part (once): the consumer in ``vllm serve``'s own
    process, the hand-over in the processes it starts. True when the Rust frontend is on."""
    if not rust_frontend(environ):
        return False
    if _started:
        return True
    inherited = folder()
    if inherited is not None and not maker_alive(inherited):
        os.environ.pop(ENV)  # left in this environment by a serve that has ended: not ours
        inherited = None
    path = folder(create=True)  # made by the first process: the processes it starts inherit it
    assert path is not None
    # vllm serve's own process makes the folder; every process it starts, however (its engine
    # cores, Ray's workers for data parallelism), inherits it while vllm serve runs.
    if inherited is None:
        from otel_llm.integrations.vllm.frontend import engine_workers, serve_stop
        from otel_llm.integrations.vllm.frontend.stream_consumer import StreamConsumer

        consumer = StreamConsumer(path).start()
        _started.append(consumer)
        serve_stop.watch(consumer.serve_stopping)
        _log.info("otel-llm: %s=1: recording vLLM's engine-core stream in this process", RUST_FRONTEND_ENV)
        engine_workers.install(consumer)  # with several local engines, each after the first in a process of its own
    else:
        from otel_llm.integrations.vllm.engine_core import engine_tap

        engine_tap.install(path)
        _started.append(engine_tap)
    return True
