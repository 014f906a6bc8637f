"""vLLM's own series beyond the core metrics, in the process that faces clients: read from vLLM's
logger's registry or recorded by its logger code on families of ours, and exported as
OpenTelemetry instruments."""
