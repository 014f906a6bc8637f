"""A tiny Llama with seeded random weights, made locally (no hub), for the real engines' suites,
benchmarks and demos (vLLM, transformers), a tokenizer for it for the servers that load one, and
LoRA adapters for it. Needs torch, transformers and tokenizers (safetensors for the adapters)."""

from __future__ import annotations

import json
import random
from pathlib import Path

VOCAB_SIZE = 512
HIDDEN_SIZE = 128
NUM_LAYERS = 2
LORA_TARGETS = ("q_proj", "v_proj")  # square projections of HIDDEN_SIZE: one shape for A and B


def make_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A 2-layer Llama (hidden 128, 2 heads of 64, vocabulary 512, 512 positions) with seeded
    random weights, saved in ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=HIDDEN_SIZE,
        intermediate_size=256,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=512,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def make_tiny_lora(path: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter for :func:`make_tiny_llama`'s model in PEFT's format (``adapter_config.json``
    and ``adapter_model.safetensors``; PEFT itself not needed), seeded random A and B of ``rank``
    on every layer's query and value projections. B is not zero (PEFT's initialisation), so the
    adapter changes what the model generates."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module in LORA_TARGETS:
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, HIDDEN_SIZE, generator=generator) * 0.1
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(HIDDEN_SIZE, rank, generator=generator) * 0.1
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "target_modules": list(LORA_TARGETS),
        "bias": "none",
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def make_tokenizer(model_dir: Path, seed: int = 0) -> Path:
    """A byte-level BPE of exactly ``VOCAB_SIZE`` entries (``<eos>`` at id 0, the 256 bytes, merges
    learnt from seeded pseudo-words), saved in ``model_dir`` beside the model, for the servers
    that load a tokenizer (vLLM's Rust frontend, ``transformers serve``): every id the model can
    emit decodes, and any text encodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    letters = "etaoinshrdlucmfw"
    corpus = [
        " ".join("".join(rng.choice(letters) for _ in range(rng.randint(2, 7))) for _ in range(50)) for _ in range(20)
    ]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer)
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the tokenizer has {tokenizer.get_vocab_size()} entries, not {VOCAB_SIZE}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")
    fast.save_pretrained(model_dir)
    return model_dir
