"""vLLM's structures read one way for both paths, in whichever process reads them: its enums, its
stats' fields (read with a check), the stat-logger path's steps and the engine-core stream's
outputs as otel-llm's events."""
