"""GGUF's non-linear 4-bit types (IQ4_NL, IQ4_XS; --expert-quant iq4_nl, iq4_xs): each 4-bit code
picks one of sixteen fixed levels, spaced closer near zero where weights are dense, times a block's
scale. IQ4_XS files are a common choice for large MoE models at about 4 bits; IQ4_NL is its
32-weight-block form. One file because the two share the levels and the nibble order.

The levels (llama.cpp's kvalues_iq4nl): -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113.
IQ4_NL (18 bytes per 32 weights, 4.5 bits): d (fp16), then 16 bytes qs, byte j holding weight j's
code in its low nibble and weight j + 16's in its high one; w = d * level[q]. IQ4_XS (136 bytes per
256, 4.25 bits): d (fp16), scales_h (16 bits, little-endian: bits 2 i, 2 i + 1 are the high two of
sub-block i's 6-bit scale), scales_l (4 bytes: sub-block i's low four bits in byte i // 2, nibble
i % 2), then for each sub-block of 32 its 16 bytes of codes as IQ4_NL orders them; w = d * (scale -
32) * level[q].

Decoding is llama.cpp's, bit for bit (the tests hold it to the gguf package's). Encoding, for
--expert-quant and the tests, is ours and plain: a block's (sub-block's) scale puts its weight of
largest magnitude, sign kept, on the level -127, each weight takes the nearest level, and IQ4_XS's
sub-block scales are rounded to 6 signed bits against d = their largest / 31. llama.cpp's
quantizer searches the scales (and weighs by an importance matrix), so its files are more accurate.

In the kernels a level is looked up without a table in memory: the sixteen levels are packed as
bytes into four 32-bit constants, the code's top two bits pick the word and its low two the byte.
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
    nibbles,
    split_nibbles,
    unsplit_nibbles,
)

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.base import in_order_dot
    from moe_serve.engine.experts.formats.ggml_block import (
        FP16,
        block_runs,
        block_tile,
        interleaved_cols,
        vector_runs,
    )
except ImportError:  # no triton: only the torch path decodes
    triton = None

LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _packed_levels(first: int) -> int:
    """Levels first..first + 3 as the bytes of one signed 32-bit word, the first in the low byte."""
    word = sum((LEVELS[first + i] & 0xFF) << 8 * i for i in range(4))
    return word - (1 << 32) if word >= 1 << 31 else word


def _nearest_levels(x: torch.Tensor) -> torch.Tensor:
    """The code of the level nearest to each x (in units of the scale): [...] -> uint8 [...]."""
    levels = torch.tensor(LEVELS, dtype=torch.float32, device=x.device)
    return torch.bucketize(x, (levels[1:] + levels[:-1]) / 2).to(torch.uint8)


def _levels_of(codes: torch.Tensor) -> torch.Tensor:
    return torch.tensor(LEVELS, dtype=torch.float32, device=codes.device)[codes.long()]


def _largest_over_first_level(w: torch.Tensor) -> torch.Tensor:
    """Per group of w [..., n], its weight of largest magnitude (sign kept) / -127: [...]."""
    return divide(w.gather(-1, w.abs().argmax(-1, keepdim=True))[..., 0], LEVELS[0])


def _codes(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Nearest level codes of w [..., n] under step [...] (0 where the step is 0: level 1 x 0)."""
    return _nearest_levels(torch.where(step[..., None] != 0, w / step[..., None], 0.0))


@dataclass(frozen=True)
class IQ4_NL(GgmlBlockFormat):
    name: ClassVar[str] = "iq4_nl"
    ggml_type: ClassVar[str] = "IQ4_NL"
    block: ClassVar[int] = 32
    block_bytes: ClassVar[int] = 18
    col_multiple: ClassVar[int] = 32

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        d = _largest_over_first_level(w).half().float()  # [...]
        return torch.cat((fp16_bytes(d), split_nibbles(_codes(w, d))), dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        return fp16_field(blocks, 0)[..., None] * _levels_of(unsplit_nibbles(blocks[..., 2:]))

    @property
    def triton_load(self) -> Any:
        return _load_iq4_nl

    @property
    def triton_dot(self) -> Any:
        return _dot_iq4_nl

    @property
    def triton_cols(self) -> Any:
        return _cols


@dataclass(frozen=True)
class IQ4_XS(GgmlBlockFormat):
    name: ClassVar[str] = "iq4_xs"
    ggml_type: ClassVar[str] = "IQ4_XS"
    block: ClassVar[int] = 256
    block_bytes: ClassVar[int] = 136
    col_multiple: ClassVar[int] = 256

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        sub = w.unflatten(-1, (8, 32))  # [..., 8, 32]
        steps = _largest_over_first_level(sub)  # [..., 8]
        d = divide(steps.abs().amax(-1), 31).half().float()  # [...]
        scales = torch.where(d[..., None] > 0, steps / d[..., None], 0.0).round_().clamp_(-32, 31)  # [..., 8]
        codes = _codes(sub, d[..., None] * scales)  # [..., 8, 32]
        stored = (scales + 32).to(torch.int32)  # 0..63
        low, high = stored & 15, stored >> 4
        scales_h = (high << 2 * torch.arange(8, device=w.device)).sum(-1)  # [...] 16 bits
        fields = (fp16_bytes(d), torch.stack((scales_h & 255, scales_h >> 8), dim=-1).to(torch.uint8),
                  nibbles(low[..., 0::2], low[..., 1::2]), split_nibbles(codes).flatten(-2))
        return torch.cat(fields, dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        scales_h = blocks[..., 2].to(torch.int32) | blocks[..., 3].to(torch.int32) << 8  # [...]
        scales_l = blocks[..., 4:8].to(torch.int32)  # [..., 4]
        low = torch.stack((scales_l & 15, scales_l >> 4), dim=-1).flatten(-2)  # [..., 8]
        high = scales_h[..., None] >> 2 * torch.arange(8, device=blocks.device) & 3
        step = fp16_field(blocks, 0)[..., None] * ((low | high << 4) - 32).float()  # [..., 8]
        codes = unsplit_nibbles(blocks[..., 8:].unflatten(-1, (8, 16)))  # [..., 8, 32]
        return (step[..., None] * _levels_of(codes)).flatten(-2)

    @property
    def triton_load(self) -> Any:
        return _load_iq4_xs

    @property
    def triton_dot(self) -> Any:
        return _dot_iq4_xs

    @property
    def triton_cols(self) -> Any:
        return _cols


if triton is not None:
    _LEVELS_0 = tl.constexpr(_packed_levels(0))
    _LEVELS_4 = tl.constexpr(_packed_levels(4))
    _LEVELS_8 = tl.constexpr(_packed_levels(8))
    _LEVELS_12 = tl.constexpr(_packed_levels(12))

    @triton.jit
    def _level(q):
        """The level of codes q (int32, 0..15), as fp32."""
        word = tl.where(q < 8, tl.where(q < 4, _LEVELS_0, _LEVELS_4), tl.where(q < 12, _LEVELS_8, _LEVELS_12))
        byte = (word >> ((q & 3) << 3)) & 255
        return ((byte << 24) >> 24).to(tl.float32)  # sign-extended

    @triton.jit
    def _xs_step(block, sub, mask):
        """IQ4_XS: the step d * (scale - 32) of sub-block `sub` (0..7, broadcasting with the block pointers
        `block`), fp32."""
        low = (tl.load(block + (4 + (sub >> 1)), mask=mask, other=0).to(tl.int32) >> ((sub & 1) << 2)) & 15
        high = (tl.load(block + (2 + (sub >> 2)), mask=mask, other=0).to(tl.int32) >> ((sub & 3) << 1)) & 3
        d = tl.load(block.to(FP16), mask=mask, other=0.0).to(tl.float32)
        return d * ((low | (high << 4)) - 32).to(tl.float32)

    @triton.jit
    def _gathered_iq4_nl(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
        """Columns k0 .. k0 + BLOCK_K (< 32: one nibble of one block) in order, gathered by column."""
        G: tl.constexpr = BLOCK_K
        R: tl.constexpr = rows.shape[0]
        block, place, mask, group, _, group_mask = block_tile(w_ptr, rows, row_ok, k0, K, BLOCK_K, 32, 18, G)
        packed = tl.load(block + (2 + (place & 15)), mask=mask, other=0, eviction_policy=EVICT).to(tl.int32)
        q = (packed >> ((place >> 4) << 2)) & 15  # [R, BLOCK_K]
        d = tl.load(group.to(FP16), mask=group_mask, other=0.0).to(tl.float32)  # [R, BLOCK_K / G]
        w = tl.reshape(_level(q), (R, BLOCK_K // G, G)) * d[:, :, None]
        return tl.reshape(w, (R, BLOCK_K))

    @triton.jit
    def _gathered_iq4_xs(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
        """Columns k0 .. k0 + BLOCK_K (< 32: one nibble of one sub-block) in order, gathered by column."""
        G: tl.constexpr = BLOCK_K
        R: tl.constexpr = rows.shape[0]
        block, place, mask, group, first, group_mask = block_tile(w_ptr, rows, row_ok, k0, K, BLOCK_K, 256, 136, G)
        # weight p: sub-block p // 32's byte p % 16, its high nibble for p % 32 >= 16
        packed = tl.load(block + (8 + ((place >> 5) << 4) + (place & 15)), mask=mask, other=0,
                         eviction_policy=EVICT).to(tl.int32)
        q = (packed >> (((place >> 4) & 1) << 2)) & 15  # [R, BLOCK_K]
        step = _xs_step(group, first >> 5, group_mask)  # [R, BLOCK_K / G]
        w = tl.reshape(_level(q), (R, BLOCK_K // G, G)) * step[:, :, None]
        return tl.reshape(w, (R, BLOCK_K))

    # A tile of whole 32-weight runs (IQ4_NL's blocks, IQ4_XS's sub-blocks) reads each run's 16 bytes
    # contiguously, in interleaved_cols' order (SPAN 16, WAYS 2); a narrower one gathers by column, in order.

    @triton.jit
    def _cols(k0, BLOCK_K: tl.constexpr):
        return interleaved_cols(k0, BLOCK_K, 16, 2)

    @triton.jit
    def _runs(w_ptr, rows, row_ok, k0, K: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr, XS: tl.constexpr):
        """The C runs of 32 weights from k0 (a multiple of 32): the codes of their bytes' low and high
        nibbles [R, C, 16] (weights j and 16 + j), each run's step [R, C], the runs [C]."""
        if XS:  # sub-block run % 8 of super-block run // 8: codes at 8 + 16 (run % 8)
            run, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, C, 32, 256, 136)  # [C], [R, C], [R, C]
            sub = run % 8
            qs = block + (8 + 16 * sub)[None, :]
            step = _xs_step(block, sub[None, :], mask)
        else:
            run, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, C, 32, 32, 18)
            qs = block + 2
            step = tl.load(block.to(FP16), mask=mask, other=0.0).to(tl.float32)
        packed = tl.load(qs[:, :, None] + tl.arange(0, 16)[None, None, :], mask=mask[:, :, None], other=0,
                         eviction_policy=EVICT).to(tl.int32)  # [R, C, 16]
        return packed & 15, packed >> 4, step, run

    @triton.jit
    def _load_runs(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr, XS: tl.constexpr):
        R: tl.constexpr = rows.shape[0]
        if BLOCK_K >= 32:
            low, high, step, _ = _runs(w_ptr, rows, row_ok, k0, K, BLOCK_K // 32, EVICT, XS)
            w = tl.reshape(tl.join(_level(low) * step[:, :, None], _level(high) * step[:, :, None]), (R, BLOCK_K))
        elif XS:
            w = _gathered_iq4_xs(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT)
        else:
            w = _gathered_iq4_nl(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT)
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w

    @triton.jit
    def _dot_runs(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr, XS: tl.constexpr):
        """Per run, step * sum(level[q] v) over both nibbles (base.ExpertFormat.triton_dot)."""
        if BLOCK_K >= 32:
            low, high, step, run = _runs(w_ptr, rows, row_ok, k0, K, BLOCK_K // 32, "evict_first", XS)
            v_low, v_high = vector_runs(v_ptr, run, K, 32, 16), vector_runs(v_ptr + 16, run, K, 32, 16)  # [C, 16]
            return tl.sum(step * tl.sum(_level(low) * v_low[None, :, :] + _level(high) * v_high[None, :, :], axis=2),
                          axis=1)
        else:
            w = _load_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, False, "evict_first", XS)
            return in_order_dot(w, v_ptr, k0, K, BLOCK_K)

    @triton.jit
    def _load_iq4_nl(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                     TRANSPOSE: tl.constexpr, EVICT: tl.constexpr):
        return _load_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, False)

    @triton.jit
    def _load_iq4_xs(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                     TRANSPOSE: tl.constexpr, EVICT: tl.constexpr):
        return _load_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, True)

    @triton.jit
    def _dot_iq4_nl(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, False)

    @triton.jit
    def _dot_iq4_xs(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, True)
