"""Block-scaled fp8 experts (--expert-quant fp8-block, and the experts of `quant_method: fp8`
checkpoints as published: Qwen3-*-FP8, DeepSeek-V3): float8 e4m3 weights with one fp32 scale per
BLOCK x BLOCK tile of the matrix, w = q * scale (the checkpoints' `weight_scale_inv`).

The scales are the checkpoint's own [ceil(N / BLOCK), ceil(K / BLOCK)] grid, so loading keeps
every bit; gate and up are encoded apart, so their halves of gate_up must each hold whole blocks
of rows (I % BLOCK == 0, as in every published checkpoint). Bytes per weight: 1 + 4 / BLOCK^2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moe_serve.engine.experts.formats.base import ExpertFormat, absmax_scales
from moe_serve.engine.experts.formats.fp8 import E4M3_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: only the torch path decodes
    triton = None

BLOCK = 128  # also written in _load


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _per_weight(scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """[..., N / BLOCK, K / BLOCK] block scales -> [..., N, K]."""
    return scales.repeat_interleave(BLOCK, dim=-2)[..., :n, :].repeat_interleave(BLOCK, dim=-1)[..., :k]


@dataclass(frozen=True)
class Fp8Block(ExpertFormat):
    name: ClassVar[str] = "fp8-block"
    data_dtype: torch.dtype = torch.uint8
    scale_dtype: torch.dtype = torch.float32
    row_multiple: ClassVar[int] = BLOCK  # gate and up each whole blocks of rows; K may end in a partial block

    def scale_cols(self, k: int) -> int:
        return _blocks(k)

    def scale_rows(self, n: int) -> int:
        return _blocks(n)

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n, k = w.shape[-2:]
        padded = F.pad(w.float(), (0, _blocks(k) * BLOCK - k, 0, _blocks(n) * BLOCK - n))
        tiles = padded.unflatten(-1, (_blocks(k), BLOCK)).unflatten(-3, (_blocks(n), BLOCK))  # [..., Nb, B, Kb, B]
        scales = absmax_scales(tiles.transpose(-3, -2).flatten(-2), E4M3_MAX).squeeze(-1)  # [..., Nb, Kb]
        q = (w.float() / _per_weight(scales, n, k)).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        return q.view(torch.uint8), scales

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        n = data.shape[-2]
        return (data.view(torch.float8_e4m3fn).float() * _per_weight(scales, n, k)).to(dtype)

    @property
    def triton_load(self) -> Any:
        return _load

    def describe(self) -> str:
        return f"fp8-block (e4m3, fp32 scale per {BLOCK}x{BLOCK} block)"


if triton is not None:

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr):
        B: tl.constexpr = 128  # BLOCK as a literal, as int4's group
        KB: tl.constexpr = (K + B - 1) // B  # scale columns
        cols = k0 + tl.arange(0, BLOCK_K)
        mask = row_ok[:, None] & (cols < K)[None, :]
        q = tl.load(w_ptr + rows[:, None] * K + cols[None, :], mask=mask, other=0, eviction_policy=EVICT)
        R: tl.constexpr = rows.shape[0]
        v = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # [R, BLOCK_K]
        # one scale load per row and block of columns, not per weight, as int4's group scales
        if B % BLOCK_K == 0:  # the tile lies in one column of blocks
            s = tl.load(s_ptr + (rows // B) * KB + k0 // B, mask=row_ok, other=0.0)  # [R]
            w = v * s[:, None]
        elif BLOCK_K % B == 0:  # the tile holds whole blocks of columns
            block = k0 // B + tl.arange(0, BLOCK_K // B)  # [BLOCK_K / B]
            s = tl.load(s_ptr + (rows // B)[:, None] * KB + block[None, :],
                        mask=row_ok[:, None] & (block < KB)[None, :], other=0.0)  # [R, BLOCK_K / B]
            w = tl.reshape(tl.reshape(v, (R, BLOCK_K // B, B)) * s[:, :, None], (R, BLOCK_K))
        else:
            s = tl.load(s_ptr + (rows // B)[:, None] * KB + (cols // B)[None, :], mask=mask, other=0.0)  # [R, BLOCK_K]
            w = v * s
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w
