"""Bad input: instrument() twice, uninstrument() restoring every name and ending in-flight spans
mid-run, a release outside the range, a check that fails, a failure of the telemetry's own code."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from otel_llm.integrations.transformers import TransformersInstrumentor, instrumentor, internals, observer
from tests.transformers.conftest import CONFIG, Instrumented, cb_config, generation_config, instrument, prompts

LOGGER = "otel_llm.integrations.transformers.instrumentor"


def originals() -> dict[str, Any]:
    """Every target's current function; those of this release only (an optional one may be absent)."""
    found = {}
    for t in internals.TARGETS:
        try:
            found[t.key] = vars(t.holder())[t.attribute]
        except ImportError:
            assert t.optional_module, t.key
    return found


def test_instrument_twice_is_idempotent_and_uninstrument_restores_every_name(caplog: pytest.LogCaptureFixture) -> None:
    before = originals()
    found = instrument(CONFIG)
    try:
        wrapped = originals()
        assert all(wrapped[k].__otel_llm_original__ is before[k] for k in before)
        found.instrumentor.instrument(config=CONFIG)
        assert originals() == wrapped  # no wrapper around a wrapper
        assert "already instrumented" in caplog.text
    finally:
        found.instrumentor.uninstrument()
    assert originals() == before


def test_uninstrument_mid_run_ends_in_flight_spans_marked(model: Any) -> None:
    found = instrument(CONFIG)
    manager = model.init_continuous_batching(generation_config(40), cb_config())
    manager.start()
    try:
        ids = [manager.add_request(p, request_id=f"r{i}", streaming=True) for i, p in enumerate(prompts(10, seed=5))]
        first = manager.get_result(timeout=60)
        assert first is not None and not first.is_finished()
        found.instrumentor.uninstrument()  # the engine is running
        finished: dict[str, Any] = {}
        while len(finished) < len(ids):
            result = manager.get_result(timeout=60)
            assert result is not None
            if result.is_finished():
                finished[result.request_id] = result
    finally:
        manager.stop(block=True, timeout=30)
    assert all(o.error is None and len(o.generated_tokens) == 40 for o in finished.values())
    spans = found.spans()
    assert sorted(spans) == sorted(ids)  # one span each: complete, or ended at uninstrument
    incomplete = [s for s in spans.values() if s.attributes.get("llm.request.incomplete") == "shutdown"]
    assert incomplete and all(s.status.status_code.name == "ERROR" for s in incomplete)
    found.meter_provider.shutdown()
    found.tracer_provider.shutdown()


def test_a_release_outside_the_range_warns_once_and_instruments_what_passes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, model: Any
) -> None:
    monkeypatch.setattr(instrumentor, "_installed", lambda: "5.99.0")
    with caplog.at_level(logging.WARNING, LOGGER):
        found = instrument(CONFIG)
    try:
        warnings = [r for r in caplog.records if r.name == LOGGER]
        assert len(warnings) == 1 and "5.99.0 is outside the tested range" in warnings[0].getMessage()
        assert "every check holds" in warnings[0].getMessage()
        run_and_count(model, found, expect_spans=True)
    finally:
        found.instrumentor.uninstrument()


def test_a_failed_check_names_what_degrades_and_the_rest_works(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, model: Any
) -> None:
    from transformers.generation.continuous_batching.continuous_api import OutputRouter

    def fail_and_deliver(self: Any, request_state: Any, error: Exception) -> None:  # a renamed parameter
        self.deliver(request_state.to_generation_output())

    monkeypatch.setattr(OutputRouter, "fail_and_deliver", fail_and_deliver)
    with caplog.at_level(logging.WARNING, LOGGER):
        found = instrument(CONFIG)
    try:
        [warning] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert "OutputRouter.fail_and_deliver takes (state, error, ...); found (request_state, error)" in warning
        assert "failed requests are not seen" in warning
        assert vars(OutputRouter)["fail_and_deliver"] is fail_and_deliver  # left alone
        run_and_count(model, found, expect_spans=True)
    finally:
        found.instrumentor.uninstrument()


def test_a_required_check_failing_wraps_none_of_the_engine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, model: Any
) -> None:
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    monkeypatch.delattr(OffloadingManager, "offload_requests")  # as if renamed
    with caplog.at_level(logging.WARNING, LOGGER):
        found = instrument(CONFIG)
    try:
        [warning] = [r.getMessage() for r in caplog.records if r.name == LOGGER]
        assert "OffloadingManager.offload_requests exists" in warning and internals.REQUIRED in warning
        assert not any(
            hasattr(vars(t.holder()).get(t.attribute), "__otel_llm_original__")
            for t in internals.TARGETS
            if t.degrades == internals.REQUIRED and t.attribute in vars(t.holder())
        )
        monkeypatch.undo()  # the engine needs its method back to run
        run_and_count(model, found, expect_spans=False)
    finally:
        found.instrumentor.uninstrument()


def test_a_failure_of_the_telemetry_never_reaches_transformers(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, model: Any, instrumented: Instrumented
) -> None:
    # A fake fault: the observer's own code raising is a bug we cannot cause otherwise.
    def broken(self: Any, processor: Any) -> None:
        raise RuntimeError("telemetry bug")

    monkeypatch.setattr(observer.BatchObserver, "batch_updated", broken)
    outputs = model.generate_batch(
        inputs=prompts(6, seed=6),
        generation_config=generation_config(16),
        continuous_batching_config=cb_config(),
        warmup=False,
    )
    assert len(outputs) == 6 and all(o.error is None and len(o.generated_tokens) == 16 for o in outputs.values())
    assert caplog.text.count("this engine's telemetry stops") == 1


def run_and_count(model: Any, found: Instrumented, expect_spans: bool) -> None:
    outputs = model.generate_batch(
        inputs=prompts(6, seed=7),
        generation_config=generation_config(16),
        continuous_batching_config=cb_config(),
        warmup=False,
    )
    assert len(outputs) == 6 and all(o.error is None for o in outputs.values())
    assert (sorted(found.spans()) == sorted(outputs)) is expect_spans


def test_the_entry_point_names_the_instrumentor() -> None:
    from importlib.metadata import entry_points

    [entry] = [e for e in entry_points(group="opentelemetry_instrumentor") if e.name == "otel_llm_transformers"]
    assert entry.load() is TransformersInstrumentor
    assert TransformersInstrumentor().instrumentation_dependencies() == ("transformers >= 5.18.0, < 5.26",)
