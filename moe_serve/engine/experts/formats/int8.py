"""int8 experts (--expert-quant int8): per-output-channel symmetric, w ≈ q * s with q in [-127, 127].

One fp32 scale per output row (absmax / 127): at K >= 1024 that is < 0.4% of the row's bytes, and
a row's weights share one dynamic range well enough that the rounding error stays ~0.5% of absmax.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.base import ExpertFormat, absmax_scales

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: only the torch path decodes
    triton = None

QMAX = 127


@dataclass(frozen=True)
class Int8(ExpertFormat):
    name: ClassVar[str] = "int8"
    data_dtype: torch.dtype = torch.int8
    scale_dtype: torch.dtype = torch.float32

    def scale_cols(self, k: int) -> int:
        return 1

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.float()
        scales = absmax_scales(w, QMAX)  # [..., N, 1]
        return (w / scales).round_().clamp_(-QMAX, QMAX).to(torch.int8), scales

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        return (data.float() * scales).to(dtype)

    @property
    def triton_load(self) -> Any:
        return _load

    def describe(self) -> str:
        return "int8 (per-channel symmetric, fp32 scales)"


if triton is not None:

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        q = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0, eviction_policy=EVICT)
        s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)  # [R] one scale per row
        w = q.to(tl.float32) * s[:, None]  # [R, BLOCK_K]
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w
