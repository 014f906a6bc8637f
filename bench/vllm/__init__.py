"""The vLLM benchmarks, each its own command run in a vLLM environment (``python -m bench.vllm.NAME``):
``engine`` (the real CPU engine, plugin on and off), ``record`` (the stat logger in vLLM's frontend),
``frontend`` (vLLM's API server on a scripted engine core), ``rust`` (the real engine under vLLM's
Rust frontend), ``stream`` (the Rust frontend's stream consumer per engine step), ``rates`` (the
engine-core stream at GPU rates; ``sender_cost``: one hand-over's, against another revision). See
bench/README.md."""
