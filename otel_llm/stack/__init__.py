"""Real back ends started locally for the drill-down from a bad bucket to a trace: Phoenix (a trace
store, in a network namespace of its own) and Prometheus (exemplar storage on), both on 127.0.0.1.
Used by ``otel-llm demo --stack`` and by the tests. See docs/drilldown.md."""
