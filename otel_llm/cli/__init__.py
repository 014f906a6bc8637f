"""The ``otel-llm`` command: ``otel_llm.cli:main``."""

from otel_llm.cli.main import main

__all__ = ["main"]
