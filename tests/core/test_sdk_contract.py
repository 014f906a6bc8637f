"""The SDK contracts (otel_llm._sdk): each private name the fast paths use, checked on the
installed SDK. On the newest SDK every contract holds; on an older one (make test-sdk-oldest) a
contract may not hold, and then the telemetry's public path is used (tests of that fallback run
on that SDK: the equivalence tests, the suite). A contract that does not hold on the newest SDK
fails here first and names what moved.
"""

from __future__ import annotations

import logging
import math
from importlib.metadata import version

import pytest

from otel_llm import TelemetryConfig, _sdk, views
from otel_llm.recording.cells import HistogramCell
from otel_llm.recording.views import provider_has_views
from tests.support.sdk_versions import at_least

# The SDK release from which each contract holds: checked on 1.28 and 1.45; the releases in
# between read from their sources (exponential_mapping: 1.28 carries a delta interval's scale
# over, 1.45 does not; the release between is not pinned down).
HOLDS_FROM = {
    "aggregation": "1.28",
    "exponential_mapping": "1.45",
    "views": "1.28",
    "tracer": "1.28",
    "batch_processor": "1.41",
    "metric_exporter": "1.28",
    "otlp_exporters": "1.28",
    "prometheus": "1.43",  # opentelemetry-exporter-prometheus 0.64b0
    "prometheus_collector": "1.28",
    "log_events": "1.38",
}


def test_every_contract_has_a_release_it_holds_from():
    assert set(HOLDS_FROM) == set(_sdk.CONTRACTS)


@pytest.mark.parametrize("name", sorted(_sdk.CONTRACTS))
def test_contract_holds_on_the_sdks_that_have_it(name):
    module, function, _ = _sdk.CONTRACTS[name]
    check = getattr(__import__(f"otel_llm._sdk.{module}", fromlist=[function]), function)
    if not at_least(HOLDS_FROM[name]):
        pytest.skip(f"{name} holds from opentelemetry-sdk {HOLDS_FROM[name]}; installed {version('opentelemetry-sdk')}")
    check()
    assert _sdk.holds(name)


def test_unmet_contracts_are_named_in_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(_sdk, "_unmet", None)
    monkeypatch.setitem(_sdk.CONTRACTS, "aggregation", ("tracer", "missing_check", _sdk.CONTRACTS["aggregation"][2]))
    with caplog.at_level(logging.WARNING, logger="otel_llm"):
        assert not _sdk.holds("aggregation")
        assert not _sdk.in_process_metrics(False)
        _sdk.holds("tracer")
    warnings = [r for r in caplog.records if "OpenTelemetry SDK" in r.getMessage()]
    assert len(warnings) == 1 and "- aggregation:" in warnings[0].getMessage()
    monkeypatch.setattr(_sdk, "_unmet", None)


def _count_takes_another_parameter(monkeypatch):
    from opentelemetry.exporter.otlp.proto.http import metric_exporter

    monkeypatch.setattr(metric_exporter, "_count_data_points", lambda request: 0, raising=False)


def _batch_size_kept_elsewhere(monkeypatch):
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    def __init__(self, max_export_batch_size=None):
        self._batch_size = max_export_batch_size

    monkeypatch.setattr(OTLPMetricExporter, "__init__", __init__)


@pytest.mark.parametrize(
    ("move", "named"),
    [
        (
            _count_takes_another_parameter,
            "http.metric_exporter._count_data_points takes (export_request, ...); found (request)",
        ),
        (
            _batch_size_kept_elsewhere,
            "grpc.metric_exporter.OTLPMetricExporter keeps max_export_batch_size in _max_export_batch_size",
        ),
    ],
    ids=["count_data_points", "max_export_batch_size"],
)
def test_the_otlp_exporters_contract_names_what_moved(monkeypatch, move, named):
    from otel_llm._sdk import otlp_exporters

    move(monkeypatch)
    with pytest.raises(_sdk.ContractError) as info:
        otlp_exporters.check()
    assert named in str(info.value)


def test_views_are_found_on_a_provider():
    from opentelemetry.sdk.metrics import MeterProvider

    config = TelemetryConfig()
    assert provider_has_views(MeterProvider(views=views(config)), config)
    assert not provider_has_views(MeterProvider(), config)


def test_cell_observation_binds_through_context():
    cell = HistogramCell((1.0, 2.0), {"a": "b"})
    cell.observe(1.5, (7, 9))
    obs = cell.observation()
    assert obs.attributes == {"a": "b"} and obs.context is not None


def _preemption_points(reader) -> list[tuple[int, tuple, tuple]]:
    data = reader.get_metrics_data()
    return [
        (p.count, tuple(p.explicit_bounds), tuple(p.bucket_counts))
        for rm in data.resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "vllm:request_num_preemptions"
        for p in m.data.data_points
    ]


def test_request_num_preemptions_reaches_every_reader_with_its_explicit_positive_buckets():
    """The in-process cell behind request_num_preemptions is read by every reader of the
    provider, through the explicit-bucket View (the configured boundaries, no others)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from otel_llm import EngineTelemetry
    from otel_llm.testing import lifecycle

    config = TelemetryConfig(model_name="tiny", defer_steps=1)
    first, second = InMemoryMetricReader(), InMemoryMetricReader()
    telemetry = EngineTelemetry(
        config, meter_provider=MeterProvider(metric_readers=[first, second], views=views(config))
    )
    for i in range(3):
        telemetry.on_events(lifecycle(f"r{i}", 10.0 + i, preemptions=i))
    expected = [(3, (0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0), (1, 1, 1, 0, 0, 0, 0, 0, 0))]
    assert _preemption_points(first) == expected
    assert _preemption_points(second) == expected


@pytest.mark.parametrize(
    "values",
    [
        (0.1, 0.12, 0.1, 0.15),  # one bucket
        (0.5, 1.0, 1.5, 2.0, 2.5, 7),  # several, on and between the bounds
        (2.5, 1.0, 0.5, 1.0, 1.5),  # unordered, two buckets
        (1.5, 1.2, 2.0),  # one bucket above the first
        (0.5, float("nan"), 1.5),  # a NaN: where one-by-one puts it
        (float("inf"), 3.0, float("-inf")),
        (2, 2, 2),  # ints: the sum stays an int
    ],
)
def test_cell_observe_many_equals_one_by_one(values):
    many, single = HistogramCell((1.0, 2.0), {}), HistogramCell((1.0, 2.0), {})
    many.windows.append([math.inf, -math.inf])
    single.windows.append([math.inf, -math.inf])
    many.observe_many(values)
    for value in values:
        single.observe(value)
    state = [(c.counts, c.min, c.max, c.windows) for c in (many, single)]
    assert repr(state[0]) == repr(state[1])
    assert repr(many.total) == repr(sum(values))
