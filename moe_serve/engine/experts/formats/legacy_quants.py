"""GGUF's first block types (Q4_0, Q4_1, Q5_0, Q5_1; --expert-quant q4_0, q4_1, q5_0, q5_1): blocks
of 32 weights along K, each with an fp16 scale d. Older GGUF files (many a Mixtral Q4_0 or Q5_0)
and llama-quantize's "pure" 4-bit types hold the experts in them. One file because the four differ
only in a min and a fifth bit.

A block is d (fp16), then for Q4_1 / Q5_1 the min m (fp16), then for Q5_0 / Q5_1 four bytes qh
(bit p of the little-endian 32-bit word is weight p's fifth bit), then 16 bytes qs: byte j holds
weight j in its low nibble and weight j + 16 in its high one. Q4_0 and Q5_0 are symmetric, w =
d * (q - 8) and d * (q - 16); Q4_1 and Q5_1 w = d * q + m. 18, 20, 22 and 24 bytes per 32 weights:
4.5, 5, 5.5 and 6 bits per weight.

Decoding is llama.cpp's, and so is encoding (the tests hold both to the gguf package's, bit for
bit): symmetric types take d = (the weight of largest magnitude, its sign kept) / -8 (-16), codes
trunc(w / d + 8.5) (16.5) capped at 15 (31); the others d = (max - min) / 15 (31), m = min, codes
trunc((w - min) / d + 0.5), all in fp32 with 1 / d as the multiplier. llama-quantize writes the
same bytes, so --expert-quant q4_0 stores what it would.
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
    split_nibbles,
    unsplit_nibbles,
)

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.base import code_dot, in_order_dot
    from moe_serve.engine.experts.formats.ggml_block import (
        FP16,
        block_runs,
        block_tile,
        interleaved_cols,
        vector_runs,
    )
except ImportError:  # no triton: only the torch path decodes
    triton = None

BLOCK = 32  # also written in the load below


class _LegacyBlock(GgmlBlockFormat):
    """One of the four: `bits` 4 or 5, `with_min` whether it stores m (and is not symmetric)."""

    bits: ClassVar[int]
    with_min: ClassVar[bool]
    block: ClassVar[int] = BLOCK
    col_multiple: ClassVar[int] = BLOCK

    @classmethod
    def qh_at(cls) -> int:
        return 4 if cls.with_min else 2

    @classmethod
    def qs_at(cls) -> int:
        return cls.qh_at() + (4 if cls.bits == 5 else 0)

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        levels = 2**self.bits
        if self.with_min:
            low = w.amin(-1, keepdim=True)  # [..., 1]
            d = divide(w.amax(-1, keepdim=True) - low, levels - 1)
            inverse = torch.where(d == 0, 0.0, 1 / d)
            q = ((w - low) * inverse + 0.5).trunc()
        else:
            largest = w.gather(-1, w.abs().argmax(-1, keepdim=True))  # [..., 1] the first of largest magnitude
            d = largest / -(levels // 2)
            inverse = torch.where(d == 0, 0.0, 1 / d)
            q = (w * inverse + (levels // 2 + 0.5)).trunc()
        q = q.clamp_(0, levels - 1).to(torch.uint8)  # [..., 32]
        fields = [fp16_bytes(d[..., 0])] + ([fp16_bytes(low[..., 0])] if self.with_min else [])
        if self.bits == 5:
            high = (q >> 4).unflatten(-1, (4, 8)).to(torch.int32)  # [..., byte, bit]
            fields.append((high << torch.arange(8, device=w.device)).sum(-1).to(torch.uint8))  # qh [..., 4]
        fields.append(split_nibbles(q))  # qs [..., 16]
        return torch.cat(fields, dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        q = unsplit_nibbles(blocks[..., self.qs_at():self.qs_at() + 16])  # [..., 32]
        if self.bits == 5:
            qh = blocks[..., self.qh_at():self.qh_at() + 4].to(torch.int32)  # [..., 4]
            q = q | ((qh[..., None] >> torch.arange(8, device=qh.device) & 1) << 4).flatten(-2)
        d = fp16_field(blocks, 0)[..., None]
        if self.with_min:
            return d * q.float() + fp16_field(blocks, 2)[..., None]
        return d * (q - 2 ** (self.bits - 1)).float()

    @property
    def triton_cols(self) -> Any:
        return _cols


@dataclass(frozen=True)
class Q4_0(_LegacyBlock):
    name: ClassVar[str] = "q4_0"
    ggml_type: ClassVar[str] = "Q4_0"
    block_bytes: ClassVar[int] = 18
    bits: ClassVar[int] = 4
    with_min: ClassVar[bool] = False

    @property
    def triton_load(self) -> Any:
        return _load_q4_0

    @property
    def triton_dot(self) -> Any:
        return _dot_q4_0


@dataclass(frozen=True)
class Q4_1(_LegacyBlock):
    name: ClassVar[str] = "q4_1"
    ggml_type: ClassVar[str] = "Q4_1"
    block_bytes: ClassVar[int] = 20
    bits: ClassVar[int] = 4
    with_min: ClassVar[bool] = True

    @property
    def triton_load(self) -> Any:
        return _load_q4_1

    @property
    def triton_dot(self) -> Any:
        return _dot_q4_1


@dataclass(frozen=True)
class Q5_0(_LegacyBlock):
    name: ClassVar[str] = "q5_0"
    ggml_type: ClassVar[str] = "Q5_0"
    block_bytes: ClassVar[int] = 22
    bits: ClassVar[int] = 5
    with_min: ClassVar[bool] = False

    @property
    def triton_load(self) -> Any:
        return _load_q5_0

    @property
    def triton_dot(self) -> Any:
        return _dot_q5_0


@dataclass(frozen=True)
class Q5_1(_LegacyBlock):
    name: ClassVar[str] = "q5_1"
    ggml_type: ClassVar[str] = "Q5_1"
    block_bytes: ClassVar[int] = 24
    bits: ClassVar[int] = 5
    with_min: ClassVar[bool] = True

    @property
    def triton_load(self) -> Any:
        return _load_q5_1

    @property
    def triton_dot(self) -> Any:
        return _dot_q5_1


if triton is not None:
    U16 = tl.constexpr(tl.pointer_type(tl.uint16))
    # A tile of whole blocks reads each block's 16 qs bytes contiguously, in interleaved_cols' order
    # (SPAN 16, WAYS 2); a narrower one lies in one nibble of its bytes and gathers them by column, in order.

    @triton.jit
    def _cols(k0, BLOCK_K: tl.constexpr):
        return interleaved_cols(k0, BLOCK_K, 16, 2)

    @triton.jit
    def _blocks(w_ptr, rows, row_ok, k0, K: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr,
                HIGH_BIT: tl.constexpr, WITH_MIN: tl.constexpr):
        """The C blocks from k0 (a multiple of 32): the codes of qs's low and high nibbles [R, C, 16]
        (weights j and 16 + j of each block, fifth bits in: 0..15 or 0..31), d and m [R, C] (a weight is
        q d + m; a symmetric type's m is its centre times -d), the blocks [C] and the mask [R, C]."""
        QH: tl.constexpr = 4 if WITH_MIN else 2
        QS: tl.constexpr = QH + 4 if HIGH_BIT else QH
        BYTES: tl.constexpr = QS + 16
        blk, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, C, 32, 32, BYTES)  # [C], [R, C], [R, C]
        lane = tl.arange(0, 16)
        packed = tl.load(block[:, :, None] + QS + lane[None, None, :], mask=mask[:, :, None], other=0,
                         eviction_policy=EVICT).to(tl.int32)  # [R, C, 16]
        low, high = packed & 15, packed >> 4
        if HIGH_BIT:  # weight p's fifth bit: bit p of qh, read as two 16-bit words (2-byte aligned in both types)
            qh_low = tl.load((block + QH).to(U16), mask=mask, other=0).to(tl.int32)  # [R, C] weights 0..15
            qh_high = tl.load((block + QH + 2).to(U16), mask=mask, other=0).to(tl.int32)  # weights 16..31
            low |= ((qh_low[:, :, None] >> lane[None, None, :]) & 1) << 4
            high |= ((qh_high[:, :, None] >> lane[None, None, :]) & 1) << 4
        d = tl.load(block.to(FP16), mask=mask, other=0.0).to(tl.float32)
        if WITH_MIN:
            m = tl.load((block + 2).to(FP16), mask=mask, other=0.0).to(tl.float32)
        else:  # (q - centre) d as one fused multiply-add, q d - centre d, rounded once
            m = d * -(16.0 if HIGH_BIT else 8.0)
        return low, high, d, m, blk, mask

    @triton.jit
    def _gathered(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr,
                  HIGH_BIT: tl.constexpr, WITH_MIN: tl.constexpr):
        """Columns k0 .. k0 + BLOCK_K (< 32: one nibble of one block's bytes) in order, each weight's
        bytes gathered by its column: [R, BLOCK_K]."""
        QH: tl.constexpr = 4 if WITH_MIN else 2
        QS: tl.constexpr = QH + 4 if HIGH_BIT else QH
        BYTES: tl.constexpr = QS + 16
        block, place, mask, first, _, first_mask = block_tile(w_ptr, rows, row_ok, k0, K, BLOCK_K, 32, BYTES, BLOCK_K)
        # weight p: qs[p % 16], its high nibble from p = 16 on; its fifth bit, bit p % 8 of qh's byte p // 8
        packed = tl.load(block + (QS + (place & 15)), mask=mask, other=0, eviction_policy=EVICT).to(tl.int32)
        q = (packed >> ((place >> 4) << 2)) & 15  # [R, BLOCK_K]
        if HIGH_BIT:
            qh = tl.load(block + (QH + (place >> 3)), mask=mask, other=0, eviction_policy=EVICT).to(tl.int32)
            q = q | (((qh >> (place & 7)) & 1) << 4)
        d = tl.load(first.to(FP16), mask=first_mask, other=0.0).to(tl.float32)  # [R, 1] the tile's one block's
        if WITH_MIN:
            return q.to(tl.float32) * d + tl.load((first + 2).to(FP16), mask=first_mask, other=0.0).to(tl.float32)
        else:
            return (q - (16 if HIGH_BIT else 8)).to(tl.float32) * d

    @triton.jit
    def _load_legacy(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                     EVICT: tl.constexpr, HIGH_BIT: tl.constexpr, WITH_MIN: tl.constexpr):
        R: tl.constexpr = rows.shape[0]
        if BLOCK_K >= 32:
            low, high, d, m, _, _ = _blocks(w_ptr, rows, row_ok, k0, K, BLOCK_K // 32, EVICT, HIGH_BIT, WITH_MIN)
            w = tl.join(low.to(tl.float32) * d[:, :, None] + m[:, :, None],
                        high.to(tl.float32) * d[:, :, None] + m[:, :, None])  # [R, C, 16, 2]
            w = tl.reshape(w, (R, BLOCK_K))
        else:
            w = _gathered(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT, HIGH_BIT, WITH_MIN)
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w

    @triton.jit
    def _dot_legacy(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr,
                    HIGH_BIT: tl.constexpr, WITH_MIN: tl.constexpr):
        """The rows' dot products with v over one tile from the blocks as read: per block,
        d * sum(q v) + m * sum(v) over both nibbles (base.ExpertFormat.triton_dot)."""
        if BLOCK_K >= 32:
            low, high, d, m, blk, _ = _blocks(w_ptr, rows, row_ok, k0, K, BLOCK_K // 32, "evict_first",
                                              HIGH_BIT, WITH_MIN)
            v_low, v_high = vector_runs(v_ptr, blk, K, 32, 16), vector_runs(v_ptr + 16, blk, K, 32, 16)  # [C, 16]
            qv = code_dot(low, v_low[None, :, :], 2) + code_dot(high, v_high[None, :, :], 2)  # [R, C]
            return tl.sum(d * qv + m * tl.sum(v_low + v_high, axis=1)[None, :], axis=1)
        else:
            w = _gathered(w_ptr, rows, row_ok, k0, K, BLOCK_K, "evict_first", HIGH_BIT, WITH_MIN)
            return in_order_dot(w, v_ptr, k0, K, BLOCK_K)

    @triton.jit
    def _load_q4_0(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_legacy(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, False, False)

    @triton.jit
    def _dot_q4_0(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_legacy(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, False, False)

    @triton.jit
    def _load_q4_1(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_legacy(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, False, True)

    @triton.jit
    def _dot_q4_1(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_legacy(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, False, True)

    @triton.jit
    def _load_q5_0(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_legacy(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, True, False)

    @triton.jit
    def _dot_q5_0(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_legacy(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, True, False)

    @triton.jit
    def _load_q5_1(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_legacy(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, True, True)

    @triton.jit
    def _dot_q5_1(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_legacy(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, True, True)
