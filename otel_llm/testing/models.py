"""A tiny Llama with seeded random weights, made locally (no hub), for the real engines' suites,
benchmarks and demos (vLLM, transformers). Needs torch and transformers."""

from __future__ import annotations

from pathlib import Path

VOCAB_SIZE = 512


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 128, 2 heads of 64, vocabulary 512, 512 positions) with seeded
    random weights, saved in ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path
