"""The deep hook's entry point under its former path, kept for installations whose metadata
still names it: :mod:`otel_llm.integrations.vllm.frontend.deep_hook`."""

from otel_llm.integrations.vllm.frontend.deep_hook import register

__all__ = ["register"]
