"""The pytest plugin of otel_llm (entry point ``pytest11``: ``otel_llm``), loaded by pytest
wherever otel-llm is installed. Fixtures:

* ``otel_llm_config`` — the TelemetryConfig that ``otel_llm_telemetry`` uses,
  ``TelemetryConfig(model_name="tiny")``; override it in a conftest.py or a test module.
* ``otel_llm_telemetry`` — an :class:`otel_llm.testing.InMemoryTelemetry` for that config,
  shut down after the test.
* ``otel_llm_telemetry_factory`` — ``make(config=None, **options)`` builds one per call (options
  of :func:`otel_llm.testing.in_memory_telemetry`); all are shut down after the test.

Nothing of OpenTelemetry (nor torch) is imported until a fixture is used: pytest imports this
module at every start-up.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator

import pytest

if TYPE_CHECKING:
    from otel_llm.config.settings import TelemetryConfig
    from otel_llm.testing.in_memory import InMemoryTelemetry


@pytest.fixture
def otel_llm_config() -> TelemetryConfig:
    """The config of ``otel_llm_telemetry``: override this fixture to change it."""
    from otel_llm.config.settings import TelemetryConfig

    return TelemetryConfig(model_name="tiny")


@pytest.fixture
def otel_llm_telemetry_factory() -> Iterator[Callable[..., InMemoryTelemetry]]:
    """``make(config=None, **options)``: a new InMemoryTelemetry per call, shut down after the test."""
    from otel_llm.testing.in_memory import in_memory_telemetry

    made: list[InMemoryTelemetry] = []

    def make(config: TelemetryConfig | None = None, **options: Any) -> InMemoryTelemetry:
        made.append(in_memory_telemetry(config, **options))
        return made[-1]

    yield make
    for rig in reversed(made):
        rig.shutdown()


@pytest.fixture
def otel_llm_telemetry(
    otel_llm_telemetry_factory: Callable[..., InMemoryTelemetry], otel_llm_config: TelemetryConfig
) -> InMemoryTelemetry:
    """An InMemoryTelemetry for ``otel_llm_config``; subscribe ``.telemetry`` to the engine's hook bus."""
    return otel_llm_telemetry_factory(otel_llm_config)
