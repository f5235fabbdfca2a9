"""Which KV blocks each sequence holds (plain Python, no torch).

The cache is `num_blocks` blocks of `block_size` token positions. A sequence's block_table lists
its blocks in position order: position p lives in block_table[p // block_size] at row
p % block_size. Blocks are reference-counted so a later prefix cache can share a system prompt's
blocks between sequences; today every block has one owner.
"""
from __future__ import annotations

from collections import deque

from moe_serve.engine.sequence import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of blocks in use (vLLM's kv_cache_usage_perc, as a fraction)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_missing(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks seq lacks to hold its first num_tokens positions."""
        return max(0, blocks_for(num_tokens, self.block_size) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_missing(seq, num_tokens) <= len(self._free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give seq the blocks for positions [0, num_tokens); check can_grow first."""
        missing = self.blocks_missing(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(f"{seq.request_id}: needs {missing} more KV blocks, {len(self._free)} are free")
        for _ in range(missing):
            block = self._free.popleft()
            self._refs[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return every block of seq at once (finish, abort, preemption)."""
        for block in seq.block_table:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free.append(block)
        seq.block_table.clear()
