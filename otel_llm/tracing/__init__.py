"""Request spans, their span events, and preemptions as log-based events."""
