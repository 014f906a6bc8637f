"""Export to the OTLP endpoint given by the standard variables, then flush and say what was
delivered; exit status 1, naming what was not, when the endpoint did not take it all.

OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 python examples/export_otlp.py
OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4318 \\
    python examples/export_otlp.py
"""

import sys
import time

from otel_llm import TelemetryConfig, setup_telemetry
from otel_llm.events import EventType as E
from otel_llm.events import RequestEvent

# metrics_exporters/traces_exporters unset: OTEL_METRICS_EXPORTER / OTEL_TRACES_EXPORTER decide (default otlp).
handle = setup_telemetry(TelemetryConfig.from_env(model_name="example"))
t = time.monotonic()
for i, preemptions in enumerate((0, 1, 3)):
    rid = f"otlp-{i}"
    events = [RequestEvent(E.ARRIVED, rid, t, prompt_tokens=8, max_tokens=4), RequestEvent(E.SCHEDULED, rid, t)]
    for _ in range(preemptions):
        events += [
            RequestEvent(E.PREEMPTED, rid, t, num_computed_tokens=8, reason="kv_cache_full"),
            RequestEvent(E.SCHEDULED, rid, t),
        ]
    events += [RequestEvent(E.TOKENS, rid, t, num_tokens=1), RequestEvent(E.FINISHED, rid, t, finish_reason="stop")]
    handle.telemetry.on_events(events)
handle.shutdown()  # flushes; the exporters' results are counted in handle.accounting
assert handle.accounting is not None  # built with every OTLP exporter
lost = handle.accounting.dropped_so_far()
if lost:
    # One write, line and newline together: an exporter thread still retrying logs to stderr too,
    # and print's separate newline let its warning land on this line.
    sys.stderr.write(
        "recorded 3 requests; NOT delivered: " + ", ".join(f"{reason}={n}" for reason, n in sorted(lost.items())) + "\n"
    )
    sys.exit(1)
delivered = handle.accounting.exported
print(f"exported 3 requests: {delivered.get('spans', 0)} spans, {delivered.get('metric_points', 0)} metric points")
