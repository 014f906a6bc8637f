"""`otel-llm doctor` beside transformers (each release of the matrix): the instrumentor's checks
on the installed release, and a doctored class named with exit status 1."""

from __future__ import annotations

import io
from importlib.metadata import version

import pytest

from otel_llm.cli.doctor import doctor

ENV = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "prometheus"}


def test_the_instrumentor_attaches_on_this_release() -> None:
    out = io.StringIO()
    assert doctor(out, ENV) == 0, out.getvalue()
    text = out.getvalue()
    assert f"transformers  {version('transformers')}: inside the tested range" in text
    assert "  ok    transformers instrumentor" in text


def test_a_renamed_method_fails_the_instrumentor(monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

    monkeypatch.delattr(ContinuousBatchProcessor, "update_batch")
    out = io.StringIO()
    assert doctor(out, ENV) == 1, out.getvalue()
    text = out.getvalue()
    assert "  FAIL  transformers instrumentor" in text and "ContinuousBatchProcessor.update_batch" in text
    assert text.rstrip().endswith("not attached or not reachable: transformers instrumentor")


def test_the_tenant_sources_of_serve_and_of_generate_batch() -> None:
    """`transformers serve` sees each request's headers; generate_batch in code sees none: a header
    source reaches the former (exit 0), a priority source neither (exit 1)."""
    out = io.StringIO()
    assert doctor(out, {**ENV, "OTEL_LLM_TENANT": "header:X-Team"}) == 0, out.getvalue()
    assert (
        "  tenant header:x-team (at most 20 values): reaches transformers serve; "
        "refused by transformers generate_batch hands over model\n"
    ) in out.getvalue()
    out = io.StringIO()
    assert doctor(out, {**ENV, "OTEL_LLM_TENANT": "baggage:team", "OTEL_LLM_TENANT_MAX_VALUES": "5"}) == 0
    assert (
        "  tenant baggage:team (at most 5 values): reaches transformers serve; "
        "refused by transformers generate_batch hands over model\n"
    ) in out.getvalue()
    out = io.StringIO()
    assert doctor(out, {**ENV, "OTEL_LLM_TENANT": "priority"}) == 1, out.getvalue()
    text = out.getvalue()
    assert (
        "  tenant priority (at most 20 values): reaches none of the entry points here; refused by "
        "transformers serve hands over model, header, baggage; transformers generate_batch hands over model\n"
    ) in text
    assert text.rstrip().endswith("not attached or not reachable: tenant source")
