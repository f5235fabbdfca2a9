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

The kernels' loads and tile dots are nibble_levels.py's, shared with GGUF's MXFP4.
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
from moe_serve.engine.experts.formats.nibble_levels import levels_of

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.ggml_block import FP16
    from moe_serve.engine.experts.formats.nibble_levels import (
        dot_level_runs,
        level_of,
        level_run_cols,
        load_level_runs,
        packed_levels,
    )
except ImportError:  # no triton: only the torch path decodes
    triton = None

LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _nearest_levels(x: torch.Tensor) -> torch.Tensor:
    """The code of the level nearest to each x (in units of the scale): [...] -> uint8 [...]."""
    levels = torch.tensor(LEVELS, dtype=torch.float32, device=x.device)
    return torch.bucketize(x, (levels[1:] + levels[:-1]) / 2).to(torch.uint8)


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
        return fp16_field(blocks, 0)[..., None] * levels_of(unsplit_nibbles(blocks[..., 2:]), LEVELS)

    @property
    def triton_load(self) -> Any:
        return _load_iq4_nl

    @property
    def triton_dot(self) -> Any:
        return _dot_iq4_nl

    @property
    def triton_cols(self) -> Any:
        return level_run_cols


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
        return (step[..., None] * levels_of(codes, LEVELS)).flatten(-2)

    @property
    def triton_load(self) -> Any:
        return _load_iq4_xs

    @property
    def triton_dot(self) -> Any:
        return _dot_iq4_xs

    @property
    def triton_cols(self) -> Any:
        return level_run_cols


if triton is not None:
    _W0, _W4, _W8, _W12 = (tl.constexpr(word) for word in packed_levels(LEVELS))

    @triton.jit
    def _level(q):
        return level_of(q, _W0, _W4, _W8, _W12)

    @triton.jit
    def _nl_step(block, sub, mask):
        """IQ4_NL: the block's d (fp16), fp32."""
        return tl.load(block.to(FP16), mask=mask, other=0.0).to(tl.float32)

    @triton.jit
    def _xs_step(block, sub, mask):
        """IQ4_XS: the step d * (scale - 32) of sub-block `sub` (0..7, broadcasting with the block pointers
        `block`), fp32."""
        low = (tl.load(block + (4 + (sub >> 1)), mask=mask, other=0).to(tl.int32) >> ((sub & 1) << 2)) & 15
        high = (tl.load(block + (2 + (sub >> 2)), mask=mask, other=0).to(tl.int32) >> ((sub & 3) << 1)) & 3
        d = tl.load(block.to(FP16), mask=mask, other=0.0).to(tl.float32)
        return d * ((low | (high << 4)) - 32).to(tl.float32)

    # IQ4_NL: blocks of 32 in 18 bytes, codes after d; IQ4_XS: of 256 in 136, codes after d, scales_h, scales_l

    @triton.jit
    def _load_iq4_nl(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                     TRANSPOSE: tl.constexpr, EVICT: tl.constexpr):
        return load_level_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 32, 18, 2, _nl_step, _level)

    @triton.jit
    def _load_iq4_xs(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr,
                     TRANSPOSE: tl.constexpr, EVICT: tl.constexpr):
        return load_level_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 256, 136, 8, _xs_step, _level)

    @triton.jit
    def _dot_iq4_nl(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return dot_level_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 32, 18, 2, _nl_step, _level)

    @triton.jit
    def _dot_iq4_xs(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return dot_level_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 256, 136, 8, _xs_step, _level)
