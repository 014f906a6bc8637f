"""Record one scripted request lifecycle and print the preemption histogram and the request span.

python examples/record_lifecycle.py
"""

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import otel_llm
from otel_llm import EngineTelemetry, RequestEvent, TelemetryConfig
from otel_llm import EventType as E

config = TelemetryConfig(model_name="tiny")
reader = InMemoryMetricReader()
spans = InMemorySpanExporter()
tracer_provider = TracerProvider()
tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
telemetry = EngineTelemetry(
    config,
    meter_provider=MeterProvider(metric_readers=[reader], views=otel_llm.views(config)),
    tracer_provider=tracer_provider,
)

t = 100.0  # the engine's time.monotonic()
telemetry.on_events(
    [
        RequestEvent(E.ARRIVED, "req-1", t, prompt_tokens=12, max_tokens=32),
        RequestEvent(E.QUEUED, "req-1", t),
        RequestEvent(E.SCHEDULED, "req-1", t + 0.01),
        # Its own growth needed the blocks it held: it is its own cause.
        RequestEvent(E.PREEMPTED, "req-1", t + 0.05, num_computed_tokens=12, reason="kv_cache_full", causes=("req-1",)),
        RequestEvent(E.SCHEDULED, "req-1", t + 0.30),
        RequestEvent(E.FIRST_TOKEN, "req-1", t + 0.35),
        RequestEvent(E.TOKENS, "req-1", t + 0.35, num_tokens=1),
        RequestEvent(E.TOKENS, "req-1", t + 0.40, num_tokens=1),
        RequestEvent(E.FINISHED, "req-1", t + 0.40, finish_reason="stop"),
    ]
)

for rm in reader.get_metrics_data().resource_metrics:
    for sm in rm.scope_metrics:
        for metric in sm.metrics:
            if metric.name == "vllm:request_num_preemptions":
                (point,) = metric.data.data_points
                print(f"{metric.name}: count={point.count} sum={point.sum}")
                for bound, count in zip((*point.explicit_bounds, "+Inf"), point.bucket_counts):
                    print(f"  le={bound}: {count}")
(span,) = spans.get_finished_spans()
print(
    f"span {span.name} trace_id={span.context.trace_id:032x} "
    f"num_preemptions={span.attributes['llm.request.num_preemptions']}"
)
for event in span.events:
    print(f"  event {event.name} {dict(event.attributes)}")
