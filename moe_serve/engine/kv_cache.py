"""Preallocated key/value cache for ONE sequence.

Positions [0, length) are valid. Speculative decoding rolls back by `truncate`: the stale entries
past `length` are simply overwritten by the next forward, so rollback costs nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # the models package imports this module
    from moe_serve.engine.models.config import ModelConfig


class KVCache:
    def __init__(
        self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int, *, device: torch.device | str,
        dtype: torch.dtype, values_are_keys: bool = False,
    ) -> None:
        shape = (num_layers, max_len, num_kv_heads, head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)  # [L, max_len, n_kv, D]
        # a latent attention's values are its keys (models/blocks.py LatentAttentionLayer): held once
        self.values = self.keys if values_are_keys else torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @classmethod
    def for_model(cls, config: ModelConfig, max_len: int, *, device: torch.device | str, dtype: torch.dtype) -> KVCache:
        return cls(config.num_layers, max_len, config.num_kv_heads, config.head_dim, device=device, dtype=dtype,
                   values_are_keys=config.values_are_keys)

    @property
    def max_len(self) -> int:
        return self.keys.shape[1]

    @property
    def nbytes(self) -> int:
        return (1 if self.values is self.keys else 2) * self.keys.numel() * self.keys.element_size()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, n_kv, D] at positions start.. and return all keys/values up to them, [start+T, n_kv, D]."""
        end = start + k.shape[0]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: positions up to {end} but max_len is {self.max_len}")
        self.keys[layer, start:end] = k
        if self.values is not self.keys:
            self.values[layer, start:end] = v
        return self.keys[layer, :end], self.values[layer, :end]

    def write_at(self, layer: int, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, n_kv, D] at a device tensor of positions [T] and return the first `span`
        keys/values [span, n_kv, D]: fixed shapes whatever the positions, so CUDA graphs can
        capture it. Entries past the positions are masked by the caller."""
        self.keys[layer].index_copy_(0, positions, k)
        if self.values is not self.keys:
            self.values[layer].index_copy_(0, positions, v)
        return self.keys[layer, :span], self.values[layer, :span]

    def truncate(self, length: int) -> None:
        """Forget every position >= length (speculative rollback)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"truncate({length}) outside [0, {self.length}]")
        self.length = length

    def reset(self) -> None:
        self.length = 0
