"""What otel-llm records, declared once as data: the metric table."""
