"""The paged KV cache: a pool of fixed-size blocks, handed out to requests through block tables."""

from __future__ import annotations

import torch

from .model import ModelConfig


class KVCache:
    """``num_blocks`` blocks of ``block_size`` token slots, for every layer, plus a free list.

    A request owns a block table (a list of block ids); its token at position ``p`` lives in slot
    ``table[p // block_size] * block_size + p % block_size`` of every layer.
    """

    def __init__(self, num_blocks: int, block_size: int, model: ModelConfig) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (model.num_layers, num_blocks * block_size, model.num_heads, model.head_dim)
        self.key_cache = torch.zeros(shape)
        self.value_cache = torch.zeros(shape)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow ``block_table`` to hold ``num_tokens`` tokens; False (and no change) if short."""
        needed = self.blocks_for(num_tokens) - len(block_table)
        if needed <= 0:
            return True
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block_table.append(self._free.pop())
        return True

    def free(self, block_table: list[int]) -> None:
        self._free.extend(reversed(block_table))
        block_table.clear()

    def slot(self, block_table: list[int], position: int) -> int:
        return block_table[position // self.block_size] * self.block_size + position % self.block_size
