"""MXFP4 experts (--expert-quant mxfp4, and the experts of `quant_method: mxfp4` checkpoints as
gpt-oss publishes them): OCP Microscaling FP4. Each run of BLOCK = 32 weights along K shares one
E8M0 scale, a bare exponent byte e meaning 2^(e - 127); each weight is an FP4 E2M1 code (sign,
2 exponent bits, 1 mantissa bit: ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}), two codes per byte, weight 2j in
the low nibble of byte j.

The data of a matrix [N, K] is [N, K / 2] bytes and its scales [N, K / BLOCK] bytes: gpt-oss's
`_blocks` [N, K / 32, 16] and `_scales` [N, K / 32] tensors are exactly these, so a published
checkpoint loads bit for bit. K must be whole blocks. 0.53 bytes per weight. GGUF files hold the same
codes and scales in GGML's 17-byte blocks, which the GGUF reader re-lays into this layout
(gguf/checkpoint.py).

Encoding picks the least power of two that fits the block's absmax into ±6 (nothing is clipped;
OCP's reference rule, floor(log2 absmax) - 2, would saturate values in (6, 8) x scale) and rounds
each weight to the nearest code, ties to the even code, as OCP rounds.

A scale byte of 0 (2^-127, not an fp32 normal) decodes as 0 and 255 (NaN in OCP) as inf, in torch
as in the kernels: both build the scale from its exponent bits, which is exact for every other
byte. Encoding writes neither (a block below 6 * 2^-126 gets 2^-126).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.base import (
    ExpertFormat,
    pack_nibbles,
    unpack_nibbles,
)

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.base import in_order_dot, word_elements
except ImportError:  # no triton: only the torch path decodes
    triton = None

BLOCK = 32  # also written in _load
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # by code; code | 8 is the negative
E8M0_BIAS = 127


def _e8m0_values(scales: torch.Tensor) -> torch.Tensor:
    """Scale bytes -> 2^(e - 127) in fp32: the byte placed in fp32's exponent bits."""
    return (scales.to(torch.int32) << 23).view(torch.float32)


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """x already divided by its block's scale -> the nearest E2M1 code (uint8), magnitudes past 6
    saturating. The threshold between magnitude codes c and c + 1 is their midpoint; a tie goes to
    the even code, so the threshold itself belongs to c + 1 exactly when c is odd."""
    magnitude = x.abs()
    codes = torch.zeros_like(x, dtype=torch.uint8)
    for c, (low, high) in enumerate(pairwise(E2M1_MAGNITUDES)):
        codes += (magnitude >= (low + high) / 2) if c % 2 else (magnitude > (low + high) / 2)
    return codes | ((x < 0).to(torch.uint8) << 3)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> their values in fp32, from the bits (no table: a tensor made from one would be
    a host-to-device copy at every decode)."""
    exponent, mantissa = (codes >> 1) & 3, (codes & 1).to(torch.int32)
    quadruple = torch.where(exponent > 0, (2 + mantissa) << exponent, 2 * mantissa)  # 4 |w|: 0, 2, 4, 6, 8, ... 24
    return torch.where(codes & 8 > 0, -quadruple, quadruple) * 0.25


@dataclass(frozen=True)
class Mxfp4(ExpertFormat):
    name: ClassVar[str] = "mxfp4"
    data_dtype: torch.dtype = torch.uint8
    scale_dtype: torch.dtype = torch.uint8
    col_multiple: ClassVar[int] = BLOCK

    def data_cols(self, k: int) -> int:
        return k // 2

    def scale_cols(self, k: int) -> int:
        return k // BLOCK

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = w.float().unflatten(-1, (-1, BLOCK))  # [..., N, K / 32, 32]
        mantissa, exponent = torch.frexp(blocks.abs().amax(dim=-1))  # absmax = mantissa * 2^exponent, [0.5, 1) * 2^n
        # the least e with absmax <= 6 * 2^e, as 6 = 0.75 * 2^3 (an all-zero block: frexp gives 0, 0, any e does)
        e = exponent - 3 + (mantissa > 0.75).to(exponent.dtype)
        scales = (e + E8M0_BIAS).clamp_(1, 2 * E8M0_BIAS).to(torch.uint8)  # [..., N, K / 32]; 0 and 255 never
        codes = _e2m1_codes(blocks / _e8m0_values(scales)[..., None]).flatten(-2)  # [..., N, K]
        return pack_nibbles(codes), scales

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_nibbles(data)  # [..., N, K]
        values = _e2m1_values(codes).unflatten(-1, (-1, BLOCK))  # [..., N, K / 32, 32]
        return (values * _e8m0_values(scales)[..., None]).flatten(-2).to(dtype)

    @property
    def triton_load(self) -> Any:
        return _load

    @property
    def triton_dot(self) -> Any:
        return _dot

    def describe(self) -> str:
        return f"mxfp4 (e2m1, e8m0 scale per {BLOCK} weights)"


if triton is not None:

    @triton.jit
    def _e8m0_to_fp32(s):
        return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)

    # an E2M1 code placed in fp32's bits is its value * 2^-126 (_e2m1_at); times the vector's element
    # scaled by VECTOR_SCALE the product is a normal float for any |v| in [2^-99, 2^28), and a block's sum
    # goes back by SUM_SCALE before its own scale
    VECTOR_SCALE = tl.constexpr(2.0**100)
    SUM_SCALE = tl.constexpr(2.0**26)
    _SIGN = tl.constexpr(-(2**31))  # bit 31 of an int32

    @triton.jit
    def _e2m1_at(words, J: tl.constexpr):
        """Nibble J of each int32 word as fp32 value * 2^-126, exactly: its exponent bits in fp32's two
        lowest exponent bits and its mantissa bit in fp32's top one (a normal float for exponents 1-3,
        the subnormal 2^-127 for code 1, as E2M1's own subnormal 0.5), its sign bit in fp32's. Three
        or four integer instructions, no conversion."""
        if J < 6:  # bits 4J .. 4J + 2 to 22 .. 24
            magnitude = (words << (22 - 4 * J)) & (7 << 22)
        else:
            magnitude = (words >> (4 * J - 22)) & (7 << 22)
        return (magnitude | ((words << (28 - 4 * J)) & _SIGN)).to(tl.float32, bitcast=True)

    @triton.jit
    def _dot(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        """The rows' dot products with v over one tile (base.ExpertFormat.triton_dot): over 32-bit words
        of 8 codes where the tile holds whole blocks, each code's value made in place (_e2m1_at) and
        multiplied into the word's sum by one FMA, a block's sum scaled once; a narrower tile (small
        test configs) through the load. At gpt-oss-20b's shape a one-token layer call took 0.074 ms
        through the generic load (0.88x bf16's) and 0.049 through this dot (1.35x; 11.2 -> 5.7 SASS
        instructions a weight), on an H200 (quant_experts-h200-{gpt-oss-20b,mxfp4-dot}.json)."""
        B: tl.constexpr = 32  # BLOCK, as in _load
        if BLOCK_K % B != 0:
            return in_order_dot(_load(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, False, "evict_first"), v_ptr, k0, K,
                                BLOCK_K)
        R: tl.constexpr = rows.shape[0]
        word = k0 // 8 + tl.arange(0, BLOCK_K // 8)  # [W]; weight 8w + j in nibble j (pack_nibbles' order)
        word_ok = word < K // 8
        words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 8) + word[None, :],
                        mask=row_ok[:, None] & word_ok[None, :], other=0,
                        eviction_policy="evict_first")  # [R, W]; rows of K / 2 bytes start 4-aligned (K % 32 == 0)
        _, v0, v1, v2, v3, v4, v5, v6, v7 = word_elements(v_ptr, word, word_ok)  # [W] each
        products = _e2m1_at(words, 0) * (v0 * VECTOR_SCALE)[None, :]  # [R, W]
        products = tl.fma(_e2m1_at(words, 1), (v1 * VECTOR_SCALE)[None, :], products)
        products = tl.fma(_e2m1_at(words, 2), (v2 * VECTOR_SCALE)[None, :], products)
        products = tl.fma(_e2m1_at(words, 3), (v3 * VECTOR_SCALE)[None, :], products)
        products = tl.fma(_e2m1_at(words, 4), (v4 * VECTOR_SCALE)[None, :], products)
        products = tl.fma(_e2m1_at(words, 5), (v5 * VECTOR_SCALE)[None, :], products)
        products = tl.fma(_e2m1_at(words, 6), (v6 * VECTOR_SCALE)[None, :], products)
        products = tl.fma(_e2m1_at(words, 7), (v7 * VECTOR_SCALE)[None, :], products)
        per_block = tl.sum(tl.reshape(products, (R, BLOCK_K // B, B // 8)), axis=2) * SUM_SCALE  # [R, BLOCK_K / 32]
        block = k0 // B + tl.arange(0, BLOCK_K // B)
        s = tl.load(s_ptr + rows[:, None] * (K // B) + block[None, :], mask=row_ok[:, None] & (block < K // B)[None, :],
                    other=0)  # [R, BLOCK_K / 32]
        return tl.sum(per_block * _e8m0_to_fp32(s), axis=1)

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr):
        # BLOCK_K a power of two >= 2 and k0 a multiple of it: the tile's bytes are whole, and it
        # lies in one block (BLOCK_K <= 32) or holds whole blocks
        B: tl.constexpr = 32  # BLOCK as a literal, as int4's group
        KB: tl.constexpr = K // 2  # bytes per row
        NB: tl.constexpr = K // B  # scales per row
        R: tl.constexpr = rows.shape[0]
        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rows[:, None] * KB + byte[None, :], mask=row_ok[:, None] & (byte < KB)[None, :],
                         other=0, eviction_policy=EVICT)  # [R, BLOCK_K / 2]; padding decodes to 0
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (R, BLOCK_K)).to(tl.uint16)  # [R, BLOCK_K]
        # E2M1 is fp16 with fewer bits: a code's sign, exponent and mantissa placed in fp16's sign, two
        # lowest exponent bits and top mantissa bit read as its value * 2^-14 (code 1 as fp16's
        # subnormal 2^-15), exactly, with no table (the load is given no pointer to one)
        half = ((codes & 8) << 12) | ((codes & 7) << 9)
        q = half.to(tl.float16, bitcast=True).to(tl.float32) * 16384.0  # [R, BLOCK_K]
        if B % BLOCK_K == 0:  # one scale per row
            s = tl.load(s_ptr + rows * NB + k0 // B, mask=row_ok, other=0)  # [R]
            w = q * _e8m0_to_fp32(s)[:, None]
        else:
            block = k0 // B + tl.arange(0, BLOCK_K // B)  # [BLOCK_K / 32]
            s = tl.load(s_ptr + rows[:, None] * NB + block[None, :], mask=row_ok[:, None] & (block < NB)[None, :],
                        other=0)  # [R, BLOCK_K / 32]
            w = tl.reshape(tl.reshape(q, (R, BLOCK_K // B, B)) * _e8m0_to_fp32(s)[:, :, None], (R, BLOCK_K))
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w
