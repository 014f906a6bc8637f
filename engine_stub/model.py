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


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    query_positions: Tensor,
    block_size: int,
) -> Tensor:
    """Causal attention of padded queries over keys/values gathered through block tables.

    query: [B, Q, H, D]; key_cache/value_cache: [num_slots, H, D], slot = block * block_size +
    offset; block_tables: [B, M] block ids (padding entries may be any valid id: the causal
    mask hides them); query_positions: [B, Q] absolute position of each query in its sequence.
    A query at position p sees the keys at positions 0..p. Returns [B, Q, H, D].
    """
    num_blocks_per_seq = block_tables.shape[1]
    key_pos = torch.arange(num_blocks_per_seq * block_size)
    slots = block_tables[:, key_pos // block_size] * block_size + key_pos % block_size  # [B, L]
    keys = key_cache[slots].transpose(1, 2)  # [B, H, L, D]
    values = value_cache[slots].transpose(1, 2)
    visible = key_pos[None, None, :] <= query_positions[:, :, None]  # [B, Q, L]
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), keys, values, attn_mask=visible[:, None]
    )
    return out.transpose(1, 2)


@dataclass
class AttentionGroup:
    """Queries attended together: one prefill chunk (B=1), or every decode token (Q=1)."""

    token_index: Tensor  # [B, Q] rows of the flat batch
    query_positions: Tensor  # [B, Q]
    block_tables: Tensor  # [B, M]


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
        self.mlp = nn.Sequential(
            nn.Linear(d, config.mlp_ratio * d), nn.GELU(), nn.Linear(config.mlp_ratio * d, d)
        )

    def forward(
        self, x: Tensor, batch: BatchInput, key_cache: Tensor, value_cache: Tensor, block_size: int
    ) -> Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(self.norm1(x)).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # Write first: a query attends to its own key and to those of earlier tokens in its chunk.
        key_cache[batch.slot_mapping] = k
        value_cache[batch.slot_mapping] = v
        attn = torch.empty_like(q)
        for group in batch.groups:
            out = paged_attention(
                q[group.token_index],
                key_cache,
                value_cache,
                group.block_tables,
                group.query_positions,
                block_size,
            )
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

    def forward(
        self, batch: BatchInput, key_cache: Tensor, value_cache: Tensor, block_size: int
    ) -> Tensor:
        """Logits [len(sample_rows), VOCAB_SIZE]; key_cache/value_cache: [layers, slots, H, D]."""
        x = self.embed(batch.token_ids) + self.positional_encoding(batch.positions)
        for layer, block in enumerate(self.blocks):
            x = block(x, batch, key_cache[layer], value_cache[layer], block_size)
        return self.lm_head(self.norm(x[batch.sample_rows]))
