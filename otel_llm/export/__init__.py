"""Export: providers, readers and exporters from config and ``OTEL_*`` (setup), OTLP, the
Prometheus endpoint, loss accounting, bounded shutdown, process identity."""
