"""Unquantized experts (--expert-quant none): the weights stored in the model's own float dtype.

Encoding is a cast, decoding a view, and the kernels' load is the plain tile load they always did.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.base import ExpertFormat

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: only the torch path decodes
    triton = None


@dataclass(frozen=True)
class Plain(ExpertFormat):
    name: ClassVar[str] = "none"
    data_dtype: torch.dtype

    @classmethod
    def for_model(cls, dtype: torch.dtype) -> Plain:
        return cls(dtype)

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, None]:
        return w.to(self.data_dtype), None

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        return data.to(dtype)  # the same tensor when dtype is the stored one: no copy

    @property
    def triton_load(self) -> Any:
        return _load

    def describe(self) -> str:
        return f"none ({str(self.data_dtype).removeprefix('torch.')})"


if triton is not None:

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr):
        cols = k0 + tl.arange(0, BLOCK_K)
        col_ok = cols < K
        if TRANSPOSE:  # [BLOCK_K, R]: a transposed view of the rows
            return tl.load(w_ptr + rows[None, :] * K + cols[:, None], mask=col_ok[:, None] & row_ok[None, :],
                           other=0.0, eviction_policy=EVICT)
        else:
            return tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                           other=0.0, eviction_policy=EVICT)
