"""A tiny decoder-only transformer whose attention reads keys and values from a paged KV cache.

Weights are random but seeded, so outputs are meaningless yet reproducible. The vocabulary is
the 256 byte values plus one stop token, so any text is a prompt.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

VOCAB_SIZE = 257
STOP_TOKEN_ID = 256


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    mlp_ratio: int = 4

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class AttentionGroup:
    """Queries attended together: one prefill chunk (B=1), or every decode token (Q=1).

    ``slots`` and ``visible`` depend only on block tables and positions, so they are built once
    per step and shared by every layer.
    """

    token_index: Tensor  # [B, Q] rows of the flat batch
    slots: Tensor  # [B, L] cache slot of each key position 0..L-1 of each sequence
    visible: Tensor  # [B, 1, Q, L] bool: the causal mask

    @classmethod
    def build(
        cls, token_index: Tensor, block_tables: Tensor, query_positions: Tensor, block_size: int
    ) -> "AttentionGroup":
        """block_tables: [B, M] block ids (padding may be any valid id: the mask hides it);
        query_positions: [B, Q] absolute position of each query; a query at p sees keys 0..p."""
        key_pos = torch.arange(block_tables.shape[1] * block_size)
        slots = block_tables[:, key_pos // block_size] * block_size + key_pos % block_size
        visible = key_pos[None, None, :] <= query_positions[:, :, None]
        return cls(token_index, slots, visible[:, None])


def paged_attention(query: Tensor, key_cache: Tensor, value_cache: Tensor, group: AttentionGroup) -> Tensor:
    """Attention of query [B, Q, H, D] over the keys/values that ``group.slots`` gathers from
    key_cache/value_cache [num_slots, H, D] (slot = block * block_size + offset). -> [B, Q, H, D]"""
    keys = key_cache[group.slots].transpose(1, 2)  # [B, H, L, D]
    values = value_cache[group.slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(query.transpose(1, 2), keys, values, attn_mask=group.visible)
    return out.transpose(1, 2)


@dataclass
class BatchInput:
    """One engine step flattened: every scheduled token of every request, in order."""

    token_ids: Tensor  # [N]
    positions: Tensor  # [N]
    slot_mapping: Tensor  # [N] where each token's key/value is written
    groups: list[AttentionGroup]
    sample_rows: Tensor  # rows whose logits are needed (last token of a sequence that samples)


class Block(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, config.mlp_ratio * d), nn.GELU(), nn.Linear(config.mlp_ratio * d, d))

    def forward(self, x: Tensor, batch: BatchInput, key_cache: Tensor, value_cache: Tensor) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # Write first: a query attends to its own key and to those of earlier tokens in its chunk.
        key_cache[batch.slot_mapping] = k
        value_cache[batch.slot_mapping] = v
        attn = torch.empty_like(q)
        for group in batch.groups:
            out = paged_attention(q[group.token_index], key_cache, value_cache, group)
            attn[group.token_index.flatten()] = out.flatten(0, 1)
        x = x + self.out(attn.reshape(n, -1))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, config: ModelConfig, seed: int) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB_SIZE, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, VOCAB_SIZE, bias=False)
        self._init_weights(seed)
        self.eval()

    def _init_weights(self, seed: int) -> None:
        # A private generator: the engine's weights never depend on (or disturb) global RNG state.
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in self.named_parameters():
                if "norm" in name:
                    continue  # LayerNorm keeps weight=1, bias=0
                if name.endswith("bias"):
                    param.zero_()
                else:
                    fan_in = param.shape[-1] if param.dim() > 1 else 1
                    std = 1.0 if name.startswith("embed") else 1.0 / math.sqrt(fan_in)
                    param.copy_(torch.randn(param.shape, generator=gen) * std)

    def positional_encoding(self, positions: Tensor) -> Tensor:
        """Sinusoidal: no table, so no maximum length other than the KV cache's."""
        half = self.config.hidden_size // 2
        freqs = torch.exp(torch.arange(half) * (-math.log(10000.0) / half))
        angles = positions[:, None].float() * freqs[None, :]
        return torch.cat([angles.sin(), angles.cos()], dim=-1)

    def forward(self, batch: BatchInput, key_cache: Tensor, value_cache: Tensor) -> Tensor:
        """Logits [len(sample_rows), VOCAB_SIZE]; key_cache/value_cache: [layers, slots, H, D]."""
        x = self.embed(batch.token_ids) + self.positional_encoding(batch.positions)
        for layer, block in enumerate(self.blocks):
            x = block(x, batch, key_cache[layer], value_cache[layer])
        return self.lm_head(self.norm(x[batch.sample_rows]))
