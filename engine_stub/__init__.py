"""engine_stub: a small continuous-batching LLM engine on torch, real enough to preempt.

A tiny seeded transformer with paged attention over a block pool, a vLLM-v1-like scheduler
(token budget, chunked prefill, recompute preemption), events through ``otel_llm.hooks``.
"""

from .engine import Engine, EngineConfig
from .model import STOP_TOKEN_ID, VOCAB_SIZE, ModelConfig
from .request import RequestOutput

__all__ = ["Engine", "EngineConfig", "ModelConfig", "RequestOutput", "STOP_TOKEN_ID", "VOCAB_SIZE"]
