"""The paged KV cache on the device, and one step's view of it (which tokens go where, who attends what).

Storage is [L, num_blocks, block_size, n_kv, D] for keys and for values; a sequence's positions
map to blocks through its block table (moe_serve/engine/kv/block_manager.py). Every sequence of a step
writes and reads it in place, so batching costs no copies and a finished sequence's blocks are
reusable at once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from moe_serve.engine.kv.paged_attention import (
    PREFILL_RUN_MIN_QUERIES,
    QueryRun,
    paged_attention,
    query_runs,
)

if TYPE_CHECKING:  # the models package imports this module
    from moe_serve.engine.kv_cache import KVCache
    from moe_serve.engine.models.config import ModelConfig


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Keys and values of one token in every layer (keys alone where the values are the keys)."""
    tensors = 1 if config.values_are_keys else 2
    per_tensor = config.num_layers * config.num_kv_heads * config.head_dim
    return tensors * per_tensor * torch.empty((), dtype=dtype).element_size()


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, *,
                 device: torch.device | str, dtype: torch.dtype, values_are_keys: bool = False) -> None:
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [L, N, B, nkv, D]
        # a latent attention's values are its keys (models/blocks.py LatentAttentionLayer): held once
        self.values = self.keys if values_are_keys else torch.zeros(shape, device=device, dtype=dtype)
        self.block_size = block_size

    @classmethod
    def for_model(cls, config: ModelConfig, num_blocks: int, block_size: int, *, device: torch.device | str,
                  dtype: torch.dtype) -> PagedKVCache:
        return cls(config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim, device=device,
                   dtype=dtype, values_are_keys=config.values_are_keys)

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return (1 if self.values is self.keys else 2) * self.keys.numel() * self.keys.element_size()

    def copy_to(self, kv: KVCache, block_table: list[int], start: int, end: int) -> None:
        """Positions [start, end) of one sequence into a contiguous one-sequence cache (every layer)."""
        slots = self._slots(block_table, start, end, kv.keys.device)
        for mine, theirs in self._pairs(kv):
            theirs[:, start:end] = mine.flatten(1, 2).index_select(1, slots)  # [L, end-start, nkv, D]

    def copy_from(self, kv: KVCache, block_table: list[int], start: int, end: int) -> None:
        """Positions [start, end) of one sequence back from a contiguous one-sequence cache."""
        slots = self._slots(block_table, start, end, kv.keys.device)
        for mine, theirs in self._pairs(kv):
            mine.flatten(1, 2).index_copy_(1, slots, theirs[:, start:end])

    def _pairs(self, kv: KVCache) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """(ours, theirs) for the keys, and the values unless both caches hold them as the keys."""
        if self.values is self.keys and kv.values is kv.keys:
            return ((self.keys, kv.keys),)
        return (self.keys, kv.keys), (self.values, kv.values)

    def _slots(self, block_table: list[int], start: int, end: int, device: torch.device) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([block_table[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.long,
                            device=device)  # [n]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [T, nkv, D] at flat slots [T] (block * block_size + row)."""
        nkv, d = k.shape[1:]
        self.keys[layer].view(-1, nkv, d).index_copy_(0, slots, k)
        if self.values is not self.keys:
            self.values[layer].view(-1, nkv, d).index_copy_(0, slots, v)


@dataclass(frozen=True)
class StepLayout:
    """The host's side of a PagedStep: per token its position, KV slot and sequence row."""

    positions: list[int]
    slots: list[int]
    query_seq: list[int]
    tables: list[list[int]]  # each sequence's block table

    @classmethod
    def of(cls, chunks: list[tuple[list[int], int, int]], block_size: int) -> StepLayout:
        """chunks: (block table, first position, tokens) per sequence, in the order its tokens are fed."""
        positions, slots, query_seq = [], [], []
        for row, (table, start, n) in enumerate(chunks):
            for p in range(start, start + n):
                positions.append(p)
                slots.append(table[p // block_size] * block_size + p % block_size)
                query_seq.append(row)
        return cls(positions, slots, query_seq, [table for table, _, _ in chunks])

    @property
    def max_span(self) -> int:
        return max(self.positions) + 1


@dataclass(frozen=True)
class PagedStep:
    """Where one forward's T tokens belong: device tensors, fixed-shape per batch so graphs can replay them."""

    cache: PagedKVCache
    positions: torch.Tensor  # [T] int64, each token's position in its sequence
    slots: torch.Tensor  # [T] int64, where its key and value are written
    query_seq: torch.Tensor  # [T] int64, its row of block_tables
    block_tables: torch.Tensor  # [S, max_blocks] int32
    max_span: int  # host bound on position + 1 over the tokens
    # an eager step's prefill chunks long enough for per-sequence attention, and every other token's
    # index (kv/paged_attention.py); none in a captured decode step
    prefill_runs: tuple[QueryRun, ...] = ()
    other_queries: torch.Tensor | None = None  # [T - tokens in prefill_runs] int64

    @classmethod
    def build(cls, cache: PagedKVCache, layout: StepLayout, device: torch.device) -> PagedStep:
        width = max(len(table) for table in layout.tables)
        tables = [table + [0] * (width - len(table)) for table in layout.tables]
        host = torch.tensor([layout.positions, layout.slots, layout.query_seq], dtype=torch.long)  # [3, T]
        dev = host.to(device, non_blocking=True)
        runs = tuple(run for run in query_runs(layout.query_seq, layout.positions)
                     if run.end - run.start >= PREFILL_RUN_MIN_QUERIES)
        others = None
        if runs:
            in_runs = {t for run in runs for t in range(run.start, run.end)}
            others = torch.tensor([t for t in range(len(layout.positions)) if t not in in_runs], dtype=torch.long)
            others = others.to(device, non_blocking=True)
        return cls(cache, dev[0], dev[1], dev[2], torch.tensor(tables, dtype=torch.int32).to(device),
                   layout.max_span, runs, others)

    def attend(self, layer: int, window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write this step's k, v [T, nkv, D], then attend q [T, nq, D] over each token's sequence -> [T, nq*D]
        (with sinks, fp32 [nq], each query head's sink logit in its softmax)."""
        self.cache.write(layer, self.slots, k, v)
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = paged_attention(q, self.cache.keys[layer], self.cache.values[layer], self.block_tables, self.query_seq,
                              self.positions, scale=scale, window=window, max_span=self.max_span,
                              prefill_runs=self.prefill_runs, other_queries=self.other_queries, sinks=sinks)
        return out.reshape(q.shape[0], -1)
