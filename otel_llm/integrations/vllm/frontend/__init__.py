"""What runs in the process that faces clients: vLLM's Python API server (the stat logger, its
adapter, the deep hook and the cause join) or, under the Rust frontend, ``vllm serve``'s own
process (the consumer of every engine core's stream)."""
