"""Q8_0 experts (GGUF Q8_0; --expert-quant q8_0): blocks of 32 weights along K, each an fp16 scale d
then 32 int8 codes, w = d * q. 34 bytes per 32 weights, 8.5 bits per weight.

Encoding is llama.cpp's reference quantizer, bit for bit (the tests hold it to the gguf package's):
d = absmax / 127, codes round(w / d) half away from zero, so --expert-quant q8_0 stores what
llama-quantize would. It is written in torch rather than called from the gguf package, whose numpy
quantizer would take minutes on the CPU for a model's experts that torch encodes on the GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.base import divide
from moe_serve.engine.experts.formats.ggml_block import (
    GgmlBlockFormat,
    fp16_bytes,
    fp16_field,
)

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.base import SUM_SCALE, VECTOR_SCALE, in_order_dot
    from moe_serve.engine.experts.formats.ggml_block import FP16, block_runs, block_tile, vector_runs
except ImportError:  # no triton: only the torch path decodes
    triton = None

BLOCK = 32  # also written in the loads below
BLOCK_BYTES = 34


@dataclass(frozen=True)
class Q8_0(GgmlBlockFormat):
    name: ClassVar[str] = "q8_0"
    ggml_type: ClassVar[str] = "Q8_0"
    block: ClassVar[int] = BLOCK
    block_bytes: ClassVar[int] = BLOCK_BYTES
    col_multiple: ClassVar[int] = BLOCK

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        d = divide(w.abs().amax(-1, keepdim=True), 127)  # [..., 1] fp32, stored as fp16
        scaled = (w * torch.where(d > 0, 1 / d, 0.0)).abs()
        whole = scaled.floor()
        q = torch.copysign(whole + (2 * (scaled - whole)).floor(), w)  # half away from zero, as llama.cpp's roundf
        return torch.cat((fp16_bytes(d[..., 0]), q.to(torch.int8).view(torch.uint8)), dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        return blocks[..., 2:].view(torch.int8).float() * fp16_field(blocks, 0)[..., None]

    @property
    def triton_load(self) -> Any:
        return _load

    @property
    def triton_dot(self) -> Any:
        return _dot


if triton is not None:
    # A tile of whole blocks reads each block's 32 codes contiguously; a narrower one lies in one block.

    @triton.jit
    def _blocks(w_ptr, rows, row_ok, k0, K: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr):
        """The C blocks from k0 (a multiple of 32): codes [R, C, 32] (fp32), d [R, C], the blocks [C]."""
        blk, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, C, 32, 32, 34)  # [C], [R, C], [R, C]
        q = tl.load(block[:, :, None] + 2 + tl.arange(0, 32)[None, None, :], mask=mask[:, :, None], other=0,
                    eviction_policy=EVICT)
        d = tl.load(block.to(FP16), mask=mask, other=0.0).to(tl.float32)
        return q.to(tl.int8, bitcast=True).to(tl.float32), d, blk

    @triton.jit
    def _in_one_block(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
        """Columns k0 .. k0 + BLOCK_K (< 32, inside one block): [R, BLOCK_K]."""
        block, place, mask, first, _, first_mask = block_tile(w_ptr, rows, row_ok, k0, K, BLOCK_K, 32, 34, BLOCK_K)
        q = tl.load(block + 2 + place, mask=mask, other=0, eviction_policy=EVICT)  # [R, BLOCK_K]
        d = tl.load(first.to(FP16), mask=first_mask, other=0.0).to(tl.float32)  # [R, 1]
        return q.to(tl.int8, bitcast=True).to(tl.float32) * d

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr):
        R: tl.constexpr = rows.shape[0]
        if BLOCK_K >= 32:
            q, d, _ = _blocks(w_ptr, rows, row_ok, k0, K, BLOCK_K // 32, EVICT)
            w = tl.reshape(q * d[:, :, None], (R, BLOCK_K))
        else:
            w = _in_one_block(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT)
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w

    @triton.jit
    def _dot(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        """Per block, d * sum(q v) (base.ExpertFormat.triton_dot), from its codes read as 16 halfwords (the
        codes start 2 bytes into a 34-byte block: 2-aligned), two codes each: with both sign bits
        flipped a halfword's bytes are u = q + 128, and each, masked in place, is a code taken as a
        subnormal float (base.code_dot): a mask and a fused multiply-add a weight, the block's sum less
        128 sum(v). (A byte a load, each converted, took 10.8 instructions a weight: bench/kernel_sass.py.)"""
        if BLOCK_K >= 32:
            C: tl.constexpr = BLOCK_K // 32
            R: tl.constexpr = rows.shape[0]
            blk, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, C, 32, 32, 34)  # [C], [R, C], [R, C]
            halves = tl.load((block + 2).to(tl.pointer_type(tl.uint16))[:, :, None] + tl.arange(0, 16)[None, None, :],
                             mask=mask[:, :, None], other=0, eviction_policy="evict_first").to(tl.int32) ^ 0x8080
            d = tl.load(block.to(FP16), mask=mask, other=0.0).to(tl.float32)  # [R, C]
            v = vector_runs(v_ptr, blk, K, 32, 32)  # [C, 32]
            v_low, v_high = tl.split(tl.reshape(v, (C, 16, 2)))  # codes 2m (low byte), 2m + 1 (high byte)
            products = ((halves & 255).to(tl.float32, bitcast=True) * (v_low * VECTOR_SCALE)[None, :, :]
                        + (halves & 0xFF00).to(tl.float32, bitcast=True) * (v_high * (VECTOR_SCALE / 256))[None, :, :])
            # each block's d applied per product, so that one sum per row runs over the whole tile
            # (a sum per block first took a warp shuffle tree each: 2 shuffles a weight)
            dv = tl.sum(tl.reshape(d[:, :, None] * products, (R, C * 16)), axis=1) * SUM_SCALE  # [R] sum(d u v)
            return dv - 128.0 * tl.sum(d * tl.sum(v, axis=1)[None, :], axis=1)
        else:
            w = _in_one_block(w_ptr, rows, row_ok, k0, K, BLOCK_K, "evict_first")
            return in_order_dot(w, v_ptr, k0, K, BLOCK_K)
