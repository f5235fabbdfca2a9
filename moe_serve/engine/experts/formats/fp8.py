"""fp8 experts (--expert-quant fp8): float8 e4m3 (OCP "fn": no infinities, max 448) with one fp32
scale per output channel, absmax / 448, so each row uses e4m3's whole range.

Per channel rather than per 128x128 block: one scale per row costs nothing to load next to the
row's weights, and e4m3's 3-bit mantissa (not the scale) bounds the error (~3% of a weight, the
same in any block). The bytes are stored as uint8 and bit-cast in the kernels, which also lets
Triton's interpreter read them.
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

E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8(ExpertFormat):
    name: ClassVar[str] = "fp8"
    data_dtype: torch.dtype = torch.uint8
    scale_dtype: torch.dtype = torch.float32

    def scale_cols(self, k: int) -> int:
        return 1

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.float()
        scales = absmax_scales(w, E4M3_MAX)  # [..., N, 1]
        q = (w / scales).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)  # round to nearest even
        return q.view(torch.uint8), scales

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        return (data.view(torch.float8_e4m3fn).float() * scales).to(dtype)

    @property
    def triton_load(self) -> Any:
        return _load

    def describe(self) -> str:
        return "fp8 (e4m3, per-channel fp32 scales)"


if triton is not None:

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr):
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        q = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0, eviction_policy=EVICT)
        s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)  # [R]
        w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * s[:, None]  # [R, BLOCK_K]
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w
