"""Why the telemetry lost something: the ``reason`` label of ``otel_llm.dropped_events``.

Every reason, from the request core (impossible events, evicted requests, internal errors) and
from the export path (batch processors, failed exports), is declared here once.
"""

# Events the request core rejected, and requests it had to let go.
UNKNOWN_REQUEST = "unknown_request"
DUPLICATE_ARRIVAL = "duplicate_arrival"
DUPLICATE_FINISH = "duplicate_finish"
AFTER_FINISH = "after_finish"
TIME_BACKWARDS = "time_backwards"
INVALID_VALUE = "invalid_value"
INVALID_TRANSITION = "invalid_transition"
UNKNOWN_EVENT_TYPE = "unknown_event_type"
EVICTED = "evicted"  # a whole request, pushed out by the in-flight cap
UNKNOWN_CAUSE = "unknown_cause"  # a preemption's cause names a request never seen (or long forgotten): no link
CAUSE_RECORDS_LOST = "cause_records_lost"  # causes an engine core could not report (its channel full)
ENGINE_STREAM_LOST = "engine_stream_lost"  # engine-core messages not handed over (consumer slow, absent)
ENGINE_STREAM_UNREADABLE = "engine_stream_unreadable"  # engine-core messages that failed to decode or translate
INTERNAL_ERROR = "internal_error"
# What the export path lost, counted in items by otel_llm.export.accounting.
SPANS_QUEUE_FULL = "spans_queue_full"  # BatchSpanProcessor queue full (collector slow or down)
SPANS_AFTER_SHUTDOWN = "spans_after_shutdown"
SPANS_EXPORT_FAILED = "spans_export_failed"  # the exporter gave up on a batch (after its retries)
METRIC_POINTS_EXPORT_FAILED = "metric_points_export_failed"  # cumulative: the next export carries them
# Log records (preemption log events), counted only where log events are on.
LOG_RECORDS_QUEUE_FULL = "log_records_queue_full"
LOG_RECORDS_AFTER_SHUTDOWN = "log_records_after_shutdown"
LOG_RECORDS_EXPORT_FAILED = "log_records_export_failed"

# Exported from the start at 0, so that every reason's series exists (Prometheus' increase()
# misses a counter series whose first sample is already 1).
DROP_REASONS = (
    UNKNOWN_REQUEST,
    DUPLICATE_ARRIVAL,
    DUPLICATE_FINISH,
    AFTER_FINISH,
    TIME_BACKWARDS,
    INVALID_VALUE,
    INVALID_TRANSITION,
    UNKNOWN_EVENT_TYPE,
    EVICTED,
    UNKNOWN_CAUSE,
    CAUSE_RECORDS_LOST,
    ENGINE_STREAM_LOST,
    ENGINE_STREAM_UNREADABLE,
    INTERNAL_ERROR,
    SPANS_QUEUE_FULL,
    SPANS_AFTER_SHUTDOWN,
    SPANS_EXPORT_FAILED,
    METRIC_POINTS_EXPORT_FAILED,
)
