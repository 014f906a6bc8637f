"""OTLP through a real collector, both protocols: plugin -> rotel -> second hop -> protobufs.

The plugin is configured only by the standard OTEL_* environment variables; rotel (a real
OTLP collector) receives on the chosen protocol and forwards on the same protocol (its HTTP
exporter gzips) to a loopback sink built on oteltest, where the decoded requests are checked
against the engine's ground truth: histogram bounds and bucket counts, `preempted` span events
with ordinals, exemplars carrying the request spans' trace ids; and delta temporality on demand.
"""

from __future__ import annotations

import re

import pytest

from tests.support.backends import backend, rotel_to_sink, start_rotel, wait_until

pytestmark = pytest.mark.backend

BOUNDS = [0.5, 1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0]
HIST = "vllm:request_num_preemptions"
PROTOCOLS = ["grpc", "http/protobuf"]
DELTA = 1  # AggregationTemporality.AGGREGATION_TEMPORALITY_DELTA in the OTLP proto
CUMULATIVE = 2


@pytest.fixture
def otlp_env(clean_env):
    monkeypatch = clean_env
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "600000")  # only our flushes export
    monkeypatch.setenv("OTEL_METRICS_EXEMPLAR_FILTER", "trace_based")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "otel-llm-test")
    return monkeypatch


@pytest.fixture(params=PROTOCOLS)
def pipeline(request, otlp_env):
    """(protocol, sink): rotel receiving on ``protocol`` and forwarding to the sink, env set."""
    protocol = request.param
    hop = "grpc" if protocol == "grpc" else "http"
    with rotel_to_sink(hop) as (sink, rotel):
        otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", rotel.endpoint(hop))
        otlp_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
        yield protocol, sink, rotel


def _engine():
    from engine_stub import Engine, EngineConfig

    return Engine(
        EngineConfig(
            num_kv_blocks=12, block_size=16, max_num_seqs=16, max_num_batched_tokens=64, seed=0, load_plugins=False
        )
    )


def _add(engine, ids) -> None:
    for i in ids:
        engine.add_request(f"req-{i:03d}", "hello world " * (1 + i % 3), max_tokens=min(150, 20 + (i * 37) % 150))


def _bucket_counts(values: list[int]) -> list[int]:
    counts = [0] * (len(BOUNDS) + 1)
    for v in values:
        counts[next((i for i, b in enumerate(BOUNDS) if v <= b), len(BOUNDS))] += 1
    return counts


def _attrs(kvs) -> dict:
    out = {}
    for kv in kvs:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind) if kind else None
    return out


def _config():
    import otel_llm

    return otel_llm.TelemetryConfig(model_name="tiny", naming="vllm", preemption_buckets=tuple(BOUNDS))


def test_otlp_through_rotel(pipeline):
    import otel_llm

    protocol, sink, rotel = pipeline
    handle = otel_llm.setup_telemetry(_config())
    try:
        engine = _engine()
        engine.hooks.subscribe(handle.telemetry)
        _add(engine, range(20))
        outputs = engine.run()
        truth = {o.request_id: o.num_preemptions for o in outputs}
        assert len(truth) == 20 and max(truth.values()) >= 5
        handle.force_flush()

        def arrived():
            points = sink.metric_points(HIST)
            spans = [s for s in sink.spans() if s.name == "llm_request"]
            return points and points[-1][1].count == len(truth) and len(spans) >= len(truth)

        try:
            wait_until(arrived, timeout=15, what=f"metrics and spans through rotel ({protocol})")
        except TimeoutError as exc:
            raise AssertionError(
                f"{exc}; sink has {sorted(sink.metric_names())}, {len(sink.spans())} spans; "
                f"rotel: {rotel.output()[-3000:]}"
            ) from None
    finally:
        handle.shutdown()

    if protocol == "http/protobuf":  # rotel's OTLP/HTTP exporter always gzips the second hop
        assert any({k.lower(): v for k, v in h.items()}.get("content-encoding") == "gzip" for h in sink.headers), (
            sink.headers[:1]
        )

    # --- the histogram: explicit bounds and exact bucket counts
    # force_flush() exported once, shutdown() may export again (cumulative: the same counts,
    # but the SDK's exemplar reservoirs reset on every collection, so no exemplars the 2nd time)
    received = sink.metric_points(HIST)
    assert 1 <= len(received) <= 2, [(p.count, len(p.exemplars)) for _, p in received]
    for metric, point in received:
        assert metric.WhichOneof("data") == "histogram"
        assert metric.histogram.aggregation_temporality == CUMULATIVE
        assert list(point.explicit_bounds) == BOUNDS
        assert list(point.bucket_counts) == _bucket_counts(list(truth.values()))
        assert point.count == len(truth)
        assert point.sum == pytest.approx(sum(truth.values()))
        assert _attrs(point.attributes).get("model_name") == "tiny"
    point = received[0][1]  # the flush, where the exemplars are

    # --- spans: one llm_request per request, `preempted` events with ordinals 1..k
    spans = {}
    for s in sink.spans():
        if s.name == "llm_request":
            rid = _attrs(s.attributes)["gen_ai.request.id"]
            assert rid not in spans, f"two spans for {rid}"
            spans[rid] = s
    assert set(spans) == set(truth)
    for rid, span in spans.items():
        k = truth[rid]
        attrs = _attrs(span.attributes)
        assert attrs["llm.request.num_preemptions"] == k, rid
        events = [e for e in span.events if e.name == "preempted"]
        assert [_attrs(e.attributes)["ordinal"] for e in events] == list(range(1, k + 1)), rid
        for e in events:
            ea = _attrs(e.attributes)
            assert ea["num_computed_tokens"] >= 0
            assert ea["reason"]
            assert span.start_time_unix_nano <= e.time_unix_nano <= span.end_time_unix_nano

    # --- exemplars: trace and span ids of request spans, the value that span recorded
    by_span_id = {s.span_id: s for s in spans.values()}
    trace_ids = {s.trace_id for s in spans.values()}
    exemplars = [ex for _, p in received for ex in p.exemplars]
    assert exemplars, "no exemplar on the preemption histogram"
    for ex in exemplars:
        assert ex.trace_id in trace_ids
        span = by_span_id[ex.span_id]
        assert span.trace_id == ex.trace_id
        value = ex.as_double if ex.WhichOneof("value") == "as_double" else ex.as_int
        assert value == _attrs(span.attributes)["llm.request.num_preemptions"]
    # one exemplar per populated bucket (the SDK's aligned-bucket reservoir)
    populated = sum(1 for c in point.bucket_counts if c)
    assert len({ex.span_id for ex in point.exemplars}) == populated


def test_delta_temporality_preference(pipeline, otlp_env):
    import otel_llm

    protocol, sink, rotel = pipeline
    otlp_env.setenv("OTEL_EXPORTER_OTLP_METRICS_TEMPORALITY_PREFERENCE", "delta")
    handle = otel_llm.setup_telemetry(_config())
    try:
        engine = _engine()
        engine.hooks.subscribe(handle.telemetry)
        _add(engine, range(6))
        first = {o.request_id: o.num_preemptions for o in engine.run()}
        handle.force_flush()
        wait_until(lambda: sink.metric_points(HIST), timeout=15, what="first delta export")
        _add(engine, range(6, 10))
        second = {o.request_id: o.num_preemptions for o in engine.run()}
        handle.force_flush()

        def all_counted():
            return sum(p.count for _, p in sink.metric_points(HIST)) == len(first) + len(second)

        try:
            wait_until(all_counted, timeout=15, what="second delta export")
        except TimeoutError as exc:
            got = [(p.count, p.start_time_unix_nano) for _, p in sink.metric_points(HIST)]
            raise AssertionError(f"{exc} ({protocol}): {got}") from None
    finally:
        handle.shutdown()

    points = [(m, p) for m, p in sink.metric_points(HIST) if p.count]
    assert [m.histogram.aggregation_temporality for m, _ in points] == [DELTA, DELTA]
    (_, p1), (_, p2) = points
    assert list(p1.bucket_counts) == _bucket_counts(list(first.values()))
    assert list(p2.bucket_counts) == _bucket_counts(list(second.values()))  # only the new requests
    assert p2.start_time_unix_nano >= p1.time_unix_nano  # delta windows do not overlap


def _debug_blocks(text: str, marker: str) -> list[str]:
    """Split rotel's detailed debug log into blocks starting at ``marker`` (e.g. "Span #")."""
    parts = re.split(rf"(?m)^(?={re.escape(marker)}\d+)", text)
    return [p for p in parts if p.startswith(marker)]


def _group(pattern: str, text: str) -> str:
    """The first group of ``pattern``'s first match in ``text``, which must match."""
    match = re.search(pattern, text)
    assert match is not None, (pattern, text)
    return match.group(1)


def test_rotel_to_rotel_debug_log(otlp_env):
    """The other second hop: rotel forwards over OTLP/HTTP (gzip) to a second rotel whose
    detailed debug log shows what arrived; the same facts read from its text."""
    import otel_llm

    with backend("rotel"):
        last_cm = start_rotel(debug_log=("metrics", "traces"))
        last = last_cm.__enter__()
    try:
        with backend("rotel"):
            first_cm = start_rotel(forward_to=last.http_endpoint, forward_protocol="http")
            first = first_cm.__enter__()
        try:
            otlp_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", first.grpc_endpoint)
            otlp_env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
            handle = otel_llm.setup_telemetry(_config())
            try:
                engine = _engine()
                engine.hooks.subscribe(handle.telemetry)
                _add(engine, range(8))
                truth = {o.request_id: o.num_preemptions for o in engine.run()}
                handle.force_flush()

                previous = [""]

                def arrived():
                    # everything there, and the log no longer growing (no half-written block)
                    text, before = last.output(), previous[0]
                    previous[0] = text
                    spans = [b for b in _debug_blocks(text, "Span #") if "Name           : llm_request" in b]
                    return f"Name: {HIST}\n" in text and len(spans) >= len(truth) and text == before and text

                try:
                    text = wait_until(arrived, timeout=15, what="debug log of the second rotel")
                except TimeoutError as exc:
                    raise AssertionError(f"{exc}: {last.output()[-3000:]}") from None
            finally:
                handle.shutdown()
        finally:
            first_cm.__exit__(None, None, None)
    finally:
        last_cm.__exit__(None, None, None)

    metric = next(b for b in _debug_blocks(text, "Metric #") if f"-> Name: {HIST}\n" in b)
    assert [float(x) for x in re.findall(r"ExplicitBounds #\d+: (\S+)", metric)] == BOUNDS
    assert [int(x) for x in re.findall(r"Buckets #\d+, Count: (\d+)", metric)] == _bucket_counts(list(truth.values()))
    assert _group(r"(?m)^Count: (\d+)$", metric) == str(len(truth))

    span_traces = {}
    for block in _debug_blocks(text, "Span #"):
        if "Name           : llm_request" not in block:
            continue
        rid = _group(r"gen_ai\.request\.id: Str\((.*?)\)", block)
        k = int(_group(r"llm\.request\.num_preemptions: Int\((\d+)\)", block))
        assert k == truth[rid]
        ordinals = [
            int(x)
            for x in re.findall(
                r"-> Name: preempted\n(?:.*\n){2}\s+-> Attributes::\n\s+-> ordinal: Int\((\d+)\)", block
            )
        ]
        assert ordinals == list(range(1, k + 1)), (rid, block)
        span_traces[_group(r"Trace ID\s+: ([0-9a-f]{32})", block)] = rid
    assert set(span_traces.values()) == set(truth)
    exemplar_traces = re.findall(r"-> Trace ID: ([0-9a-f]{32})", metric)
    assert exemplar_traces and set(exemplar_traces) <= set(span_traces)
