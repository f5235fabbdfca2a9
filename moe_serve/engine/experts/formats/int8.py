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

    from moe_serve.engine.experts.formats.base import SUM_SCALE, byte_code_products, in_order_dot
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
        q = (w / scales).round_().clamp_(-QMAX, QMAX).to(torch.int8)
        # an all-zero row keeps scale 0, not absmax_scales' 1: the tile dot sums codes offset by 128
        # and takes 128 sum(v) off after, whose rounding the scale multiplies
        return q, scales.masked_fill(q.eq(0).all(-1, keepdim=True), 0.0)

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        return (data.float() * scales).to(dtype)

    @property
    def triton_load(self) -> Any:
        return _load

    @property
    def triton_dot(self) -> Any:
        return _dot

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

    @triton.jit
    def _dot(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        """The rows' dot products with v over one tile (base.ExpertFormat.triton_dot), read as 32-bit
        words of 4 codes (K a multiple of 4: the rows start 4-aligned): each word's sign bits flipped
        make its bytes u = q + 128 (0..255), and each byte masked in place is a code taken as a
        subnormal float (base.byte_code_products): a mask and a fused multiply-add a weight, no int-to-float conversion. The row's sum is s (sum(u v) - 128 sum(v))."""
        if K % 4 == 0 and BLOCK_K % 4 == 0:
            KW: tl.constexpr = K // 4
            W: tl.constexpr = BLOCK_K // 4
            word = k0 // 4 + tl.arange(0, W)  # [W]
            word_ok = word < KW
            words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * KW + word[None, :],
                            mask=row_ok[:, None] & word_ok[None, :], other=0,
                            eviction_policy="evict_first") ^ -0x7F7F7F80  # [R, W] 0x80808080: u = q + 128
            v4 = tl.load(v_ptr + 4 * word[:, None] + tl.arange(0, 4)[None, :], mask=word_ok[:, None],
                         other=0.0).to(tl.float32)  # [W, 4]; a masked word meets v = 0
            products = byte_code_products(words, 255, 0, v4)  # [R, W] sum(u v) / SUM_SCALE per word
            s = tl.load(s_ptr + rows, mask=row_ok, other=0.0)  # [R] one scale per row
            return s * (tl.sum(products, axis=1) * SUM_SCALE - 128.0 * tl.sum(v4))
        else:
            return in_order_dot(_load(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, False, "evict_first"), v_ptr, k0,
                                K, BLOCK_K)
