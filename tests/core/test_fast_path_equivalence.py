"""The in-process aggregation must produce exactly the data points of the straightforward SDK path.

Both run on the same events (many requests, preemptions, tokens, steps, drops), on providers
built with the same otel_llm.views(config); every data point is compared field by field except
timestamps. Exemplars are compared by (value, trace id, span id) after mapping each path's
trace ids to request ids (the two paths create different spans).
"""

from __future__ import annotations

import pytest

from otel_llm import TelemetryConfig
from otel_llm.testing import in_memory_telemetry
from tests.support.otel_helpers import FAST, SDK, Paths, assert_same_snapshots, attrs, workload


def comparable(r, span_ids, delta):
    out = {}
    for name, points in r.metrics().items():
        for p in points:
            if delta and getattr(p, "value", None) == 0:
                # An observable counter reports every interval, a synchronous one only intervals
                # with measurements: a zero delta and no point say the same.
                continue
            key = (name, tuple(sorted(p.attributes.items())))
            if hasattr(p, "bucket_counts"):
                exemplars = sorted((e.value, span_ids.get(e.trace_id)) for e in p.exemplars)
                out[key] = (p.bucket_counts, p.explicit_bounds, p.count, pytest.approx(p.sum), p.min, p.max, exemplars)
            else:
                out[key] = p.value
    return out


def run(paths: Paths, naming: str, delta: bool):
    r = in_memory_telemetry(TelemetryConfig(model_name="tiny", naming=naming), **paths, delta=delta)
    batches, steps = workload()
    snapshots = []
    for i, batch in enumerate(batches):
        r.telemetry.on_events(batch)
        r.telemetry.on_step(steps[i % len(steps)])
        if i % 20 == 19:  # several collections: delta intervals and exemplar resets are exercised
            span_ids = {s.context.trace_id: attrs(s.attributes)["gen_ai.request.id"] for s in r.finished_spans()}
            snapshots.append(comparable(r, span_ids, delta))
    return snapshots


@pytest.mark.parametrize("naming", ["vllm", "semconv"])
@pytest.mark.parametrize("delta", [False, True], ids=["cumulative", "delta"])
def test_fast_path_equals_sdk_path(naming, delta):
    fast, sdk = run(FAST, naming, delta), run(SDK, naming, delta)
    assert_same_snapshots(fast, sdk, 3)
