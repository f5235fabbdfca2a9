"""int4 experts (--expert-quant int4): group-wise symmetric, two weights per byte.

Each run of GROUP_SIZE weights along K (fewer where K is smaller; the last group of a row may be
partial) shares one fp16 scale, absmax / 7, and stores q + 8 (q = round(w / scale) in [-7, 7]) as a
nibble: weight 2j in the low nibble of byte j, weight 2j + 1 in the high one (a row of odd K ends
with a zero nibble).
Symmetric, without zero points: expert weights are centred on zero, so an offset would buy
little over the 15 levels used, and it would cost a second tensor per group and an extra
subtraction per weight in the kernels. fp16 scales (as GPTQ and AWQ keep them): 2 bytes per 64
bytes of weights, 0.52 bytes per weight in all, 0.26x bf16.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moe_serve.engine.experts.formats.base import (
    ExpertFormat,
    absmax_scales,
    pack_nibbles,
    unpack_nibbles,
)

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.base import SUM_SCALE, VECTOR_SCALE, code_fma, word_elements
except ImportError:  # no triton: only the torch path decodes
    triton = None

GROUP_SIZE = 128  # also written in _load
QMAX = 7
ZERO = 8  # the nibble of q = 0


def group_size(k: int) -> int:
    return min(GROUP_SIZE, k)


@dataclass(frozen=True)
class Int4(ExpertFormat):
    name: ClassVar[str] = "int4"
    data_dtype: torch.dtype = torch.uint8
    scale_dtype: torch.dtype = torch.float16

    def data_cols(self, k: int) -> int:
        return (k + 1) // 2

    def scale_cols(self, k: int) -> int:
        return -(-k // group_size(k))

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, g = w.shape[-1], group_size(w.shape[-1])
        groups = self.scale_cols(k)
        padded = F.pad(w.float(), (0, groups * g - k)).unflatten(-1, (groups, g))  # [..., N, G, g]
        scales = absmax_scales(padded, QMAX, torch.float16).squeeze(-1)  # [..., N, G]
        q = (padded / scales.float()[..., None]).round_().clamp_(-QMAX - 1, QMAX).flatten(-2)[..., :k]  # [..., N, K]
        # an odd row ends in the nibble of q = 0, not pack_nibbles' 0 (-8 here): padding decodes to 0
        return pack_nibbles(F.pad((q + ZERO).to(torch.uint8), (0, k % 2), value=ZERO)), scales

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        nibbles = unpack_nibbles(data)[..., :k]  # [..., N, K]
        per_weight = scales.float().repeat_interleave(group_size(k), dim=-1)[..., :k]  # [..., N, K]
        return ((nibbles.float() - ZERO) * per_weight).to(dtype)

    @property
    def triton_load(self) -> Any:
        return _load

    @property
    def triton_dot(self) -> Any:
        return _dot

    def describe(self) -> str:
        return f"int4 (group {GROUP_SIZE} symmetric, fp16 scales)"


if triton is not None:
    _ZERO = tl.constexpr(ZERO)

    @triton.jit
    def _float_minus(v, bias: tl.constexpr):
        """v - bias as float32, exactly, for int32 0 <= v < 2**23: v's bits OR'd into the mantissa of 2**23
        make the float 2**23 + v. An OR and one subtraction at full rate instead of an int-to-float
        conversion, which runs at a fraction of it: 11% off a 32-token Mixtral-size layer call on an
        H200 (bench/results/quant/quant_experts-h200*.json), none at one token."""
        return (v | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr):
        # BLOCK_K even and k0 a multiple of it: the tile's bytes are whole
        KB: tl.constexpr = (K + 1) // 2  # bytes per row
        # GROUP_SIZE as a literal: Triton's interpreter cannot take an int % a module-level constexpr
        G: tl.constexpr = 128 if K > 128 else K
        NG: tl.constexpr = (K + G - 1) // G  # scales per row
        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rows[:, None] * KB + byte[None, :], mask=row_ok[:, None] & (byte < KB)[None, :],
                         other=_ZERO * 17, eviction_policy=EVICT)  # [R, BLOCK_K / 2]; padding decodes to 0
        R: tl.constexpr = rows.shape[0]
        nibbles = tl.reshape(tl.join(packed & 0xF, packed >> 4), (R, BLOCK_K)).to(tl.int32)  # [R, BLOCK_K]
        q = _float_minus(nibbles, _ZERO)  # [R, BLOCK_K]
        # one scale load per row and group, not per weight, where the tile and the groups align
        # (the fp16 scales would otherwise be read 4x the packed weights' bytes from L1)
        if G % BLOCK_K == 0:  # the tile lies in one group
            s = tl.load(s_ptr + rows * NG + k0 // G, mask=row_ok, other=0.0)  # [R]
            w = q * s.to(tl.float32)[:, None]
        elif BLOCK_K % G == 0:  # the tile holds whole groups
            group = k0 // G + tl.arange(0, BLOCK_K // G)  # [BLOCK_K / G]
            s = tl.load(s_ptr + rows[:, None] * NG + group[None, :], mask=row_ok[:, None] & (group < NG)[None, :],
                        other=0.0)  # [R, BLOCK_K / G]
            w = tl.reshape(tl.reshape(q, (R, BLOCK_K // G, G)) * s.to(tl.float32)[:, :, None], (R, BLOCK_K))
        else:  # a small odd K (one group of K): each weight's group scale
            cols = k0 + tl.arange(0, BLOCK_K)
            s = tl.load(s_ptr + rows[:, None] * NG + (cols // G)[None, :], mask=row_ok[:, None] & (cols < K)[None, :],
                        other=0.0)  # [R, BLOCK_K]
            w = q * s.to(tl.float32)
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w

    @triton.jit
    def _dot(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        """The rows' dot products with v over one tile (base.ExpertFormat.triton_dot), the weights never
        put back into order (a layout shuffle through shared memory): where the tile holds whole
        groups of whole 32-bit words, _dot_words; else each byte's low and high nibbles multiply v's
        even and odd elements, each with its own group's scale (small or odd K only).

        On an H200, a Mixtral-size layer call at one token (fused kernel, best tiles of each): 0.121
        ms with bytes (low/high nibbles as int32, converted, times v's even/odd elements), 0.108 with
        words and v loaded at a stride of 8, 0.103 with words and v split in registers (bf16: 0.176);
        at 4 tokens 0.424, 0.360, 0.348 (bf16 0.545)."""
        G: tl.constexpr = 128 if K > 128 else K  # GROUP_SIZE, as in _load
        if K % 8 == 0 and G % 8 == 0 and BLOCK_K % G == 0:
            return _dot_words(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr)
        KB: tl.constexpr = (K + 1) // 2  # bytes per row
        NG: tl.constexpr = (K + G - 1) // G
        half = tl.arange(0, BLOCK_K // 2)
        byte = k0 // 2 + half
        packed = tl.load(w_ptr + rows[:, None] * KB + byte[None, :], mask=row_ok[:, None] & (byte < KB)[None, :],
                         other=_ZERO * 17, eviction_policy="evict_first")  # [R, BLOCK_K / 2]; padding decodes to 0
        low = _float_minus((packed & 0xF).to(tl.int32), _ZERO)  # weights k0, k0 + 2, ...
        high = _float_minus((packed >> 4).to(tl.int32), _ZERO)  # weights k0 + 1, k0 + 3, ...
        even = k0 + 2 * half
        v_even = tl.load(v_ptr + even, mask=even < K, other=0.0).to(tl.float32)  # [BLOCK_K / 2]
        v_odd = tl.load(v_ptr + even + 1, mask=even + 1 < K, other=0.0).to(tl.float32)
        s_even = tl.load(s_ptr + rows[:, None] * NG + (even // G)[None, :],
                         mask=row_ok[:, None] & (even < K)[None, :], other=0.0).to(tl.float32)
        s_odd = tl.load(s_ptr + rows[:, None] * NG + ((even + 1) // G)[None, :],
                        mask=row_ok[:, None] & (even + 1 < K)[None, :], other=0.0).to(tl.float32)
        return tl.sum(low * s_even * v_even[None, :] + high * s_odd * v_odd[None, :], axis=1)

    @triton.jit
    def _dot_words(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        """_dot over 32-bit words, for K a multiple of 8 and tiles of whole groups (nibble_group_sums):
        the zero point comes off once per group and row, as 8 times the group's sum of v, before the
        group's scale: sum((n - 8) v) = sum(n v) - 8 sum(v)."""
        G: tl.constexpr = 128 if K > 128 else K
        NG: tl.constexpr = (K + G - 1) // G
        # the rows' bytes start 4-aligned: K / 2 a multiple of 4
        per_group, v_group = nibble_group_sums(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, K // 8, G)
        group = k0 // G + tl.arange(0, BLOCK_K // G)  # [BLOCK_K / G]
        s = tl.load(s_ptr + rows[:, None] * NG + group[None, :], mask=row_ok[:, None] & (group < NG)[None, :],
                    other=0.0)  # [R, BLOCK_K / G]
        return tl.sum((per_group - _ZERO * v_group[None, :]) * s.to(tl.float32), axis=1)

    @triton.jit
    def nibble_group_sums(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr,
                          ROW_WORDS: tl.constexpr, G: tl.constexpr):
        """Per row and group of G weights in the tile, sum(n v) over its nibbles n [R, BLOCK_K / G], and
        per group sum(v) [BLOCK_K / G], from the rows' 32-bit words (ROW_WORDS apart, 4-aligned; 8
        weights a word, weight 8w + j in nibble j, as pack_nibbles orders them; BLOCK_K whole groups):
        two instructions a weight, a mask and a fused multiply-add. Nibble j < 4 of a word (j - 4 of the
        word shifted right by 16), masked in place, is a code times 16**j taken as a subnormal float
        (base.code_dot), all of a word's nibbles summed into one fp32 per word (int4 and int4-zp).

        Before, int4's dot OR'd each nibble into the mantissa of 2**23: a mask, a subtraction of 2**23,
        a product and an add (plus a move of the second constant), 5.5 instructions a weight in the
        one-token gate/up loop against 3.3 now (its sm_90 SASS, bench/kernel_sass.py), and a
        Mixtral-size layer call 0.110 ms against 0.079 now on an H200."""
        R: tl.constexpr = rows.shape[0]
        word = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [BLOCK_K / 8]
        word_ok = word < K // 8
        words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * ROW_WORDS + word[None, :],
                        mask=row_ok[:, None] & word_ok[None, :], other=0,
                        eviction_policy="evict_first")  # [R, BLOCK_K / 8]; a masked word meets v = 0
        upper = words >> 16  # nibbles 4..7 where 0..3 were (sign bits land above the masks)
        v8, v0, v1, v2, v3, v4, v5, v6, v7 = word_elements(v_ptr, word, word_ok)  # [BLOCK_K / 8, 8], [BLOCK_K / 8] each
        products = (words & 15).to(tl.float32, bitcast=True) * (v0 * VECTOR_SCALE)[None, :]  # [R, BLOCK_K / 8]
        products = code_fma(words, 15, 4, v1, products)
        products = code_fma(words, 15, 8, v2, products)
        products = code_fma(words, 15, 12, v3, products)
        products = code_fma(upper, 15, 0, v4, products)
        products = code_fma(upper, 15, 4, v5, products)
        products = code_fma(upper, 15, 8, v6, products)
        products = code_fma(upper, 15, 12, v7, products)  # sum(n v) / SUM_SCALE per word
        per_group = tl.sum(tl.reshape(products, (R, BLOCK_K // G, G // 8)), axis=2) * SUM_SCALE
        v_group = tl.sum(tl.reshape(tl.sum(v8, axis=1), (BLOCK_K // G, G // 8)), axis=1)
        return per_group, v_group
