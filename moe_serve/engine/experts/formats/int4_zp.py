"""Asymmetric group-wise int4 experts with zero points: the weights of GPTQ and AWQ checkpoints as
published (quantized_checkpoints/gptq.py, awq.py), and --expert-quant int4-zp-g32/-g64/-g128.

Each run of `group_size` weights along K shares one fp16 scale s and one 4-bit zero point z, and a
weight is w = (q - z) * s with its code q in 0..15. K must be whole groups (every published
checkpoint's is). A row of the data holds the row's K codes, two per byte (weight 2j in the low
nibble of byte j, as int4.py packs them), then its K / group_size zeros packed the same way and
padded to 16 bytes, so that every row, and the codes in it, start 16-byte aligned for vector loads
of the codes; the scales section holds the K / group_size scales of each row. Checkpoints' codes,
zeros and scales are re-laid losslessly, in the bytes they are published in (0.5 + 2.5 / group_size
per weight) plus that padding (under 16 bytes a row).

One registered format per group size: the Triton load's signature is fixed, and the group size
must be a compile-time constant of it (it decides whether a tile lies in one group or holds
several, and shapes the tile's reshape into groups), so each size has its own jit entry point over
one shared body. A name per size also lets a checkpoint's config name its experts' format (and
the memory plan size their rows) before any tensor is read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from moe_serve.engine.experts.formats.base import (
    ExpertFormat,
    divide,
    pack_nibbles,
    unpack_nibbles,
)

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.base import in_order_dot
    from moe_serve.engine.experts.formats.int4 import nibble_group_sums
except ImportError:  # no triton: only the torch path decodes
    triton = None

QMAX = 15  # codes and zero points are 0..15
_ALIGN = 16  # bytes: the zeros after a row's codes are padded to it, also written in _load


def zero_bytes(groups: int) -> int:
    """Bytes after a row's codes holding its `groups` zero points: two per byte, 16-byte padded."""
    packed = (groups + 1) // 2
    return -(-packed // _ALIGN) * _ALIGN


def dequantize(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reference dequantization w = (q - z) * s: codes [..., N, K], zeros and scales [..., N, G]
    (one per group of K / G weights) -> [..., N, K] in dtype. Exact in fp32: q - z is a small
    integer and s an fp16."""
    per_group = codes.float().unflatten(-1, (scales.shape[-1], -1))  # [..., N, G, K / G]
    return ((per_group - zeros.float()[..., None]) * scales.float()[..., None]).flatten(-2).to(dtype)


def _fp16_at_least(x: torch.Tensor) -> torch.Tensor:
    """x (fp32, >= 0) as fp16 rounded up, so a group's range / scale stays <= 15 levels; 1 for 0."""
    rounded = x.to(torch.float16)
    rounded = torch.where(rounded.float() < x, torch.nextafter(rounded, torch.full_like(rounded, torch.inf)), rounded)
    return torch.where(rounded > 0, rounded, 1.0)


@dataclass(frozen=True)
class Int4ZeroPoint(ExpertFormat):
    """The format; its subclasses below fix the group size (one --expert-quant name each)."""

    group_size: ClassVar[int]
    data_dtype: torch.dtype = torch.uint8
    scale_dtype: torch.dtype = torch.float16

    def data_cols(self, k: int) -> int:
        return k // 2 + zero_bytes(k // self.group_size)

    def scale_cols(self, k: int) -> int:
        return k // self.group_size

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Round to nearest over each group's range widened to hold 0 (as GPTQ's quantizer does):
        the zero point is then a whole level, 0 decodes exactly, and the error is at most half a step."""
        self.check_shape(*w.shape[-2:])
        groups = w.float().unflatten(-1, (-1, self.group_size))  # [..., N, G, g]
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)  # [..., N, G]
        scales = _fp16_at_least(divide(high - low, QMAX))  # [..., N, G]
        zeros = (-low / scales.float()).round_().clamp_(0, QMAX)  # [..., N, G]
        codes = (groups / scales.float()[..., None]).round_().add_(zeros[..., None]).clamp_(0, QMAX).flatten(-2)
        return self.pack(codes.to(torch.uint8), zeros.to(torch.uint8), scales)

    def pack(self, codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Already quantized weights -> (data, scales) of this format: codes [..., N, K] and zeros
        [..., N, K / group_size] in 0..15 (uint8), scales [..., N, K / group_size] fp16; kept as given."""
        zero_row = pack_nibbles(zeros)  # [..., N, ceil(G / 2)]
        padding = zero_bytes(zeros.shape[-1]) - zero_row.shape[-1]
        return torch.cat((pack_nibbles(codes), F.pad(zero_row, (0, padding))), dim=-1), scales

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_nibbles(data[..., : k // 2])  # [..., N, K]
        zeros = unpack_nibbles(data[..., k // 2 :])[..., : k // self.group_size]  # [..., N, G]
        return dequantize(codes, zeros, scales, dtype)

    @property
    def triton_load(self) -> Any:
        return _LOADS[self.group_size]

    @property
    def triton_dot(self) -> Any:
        return _DOTS[self.group_size]

    def triton_codes_for(self, k: int, block_k: int) -> Any | None:
        return _CODES[self.group_size] if self.group_size % block_k == 0 else None  # a tile inside one group

    def describe(self) -> str:
        return f"{self.name} (group {self.group_size} asymmetric, 4-bit zero points, fp16 scales)"


class Int4ZeroPointG32(Int4ZeroPoint):
    name: ClassVar[str] = "int4-zp-g32"
    group_size: ClassVar[int] = 32
    col_multiple: ClassVar[int] = 32


class Int4ZeroPointG64(Int4ZeroPoint):
    name: ClassVar[str] = "int4-zp-g64"
    group_size: ClassVar[int] = 64
    col_multiple: ClassVar[int] = 64


class Int4ZeroPointG128(Int4ZeroPoint):
    name: ClassVar[str] = "int4-zp-g128"
    group_size: ClassVar[int] = 128
    col_multiple: ClassVar[int] = 128


FORMATS_BY_GROUP_SIZE = {fmt.group_size: fmt for fmt in (Int4ZeroPointG32, Int4ZeroPointG64, Int4ZeroPointG128)}


if triton is not None:

    @triton.jit
    def _codes_in_order(w_ptr, rows, row_ok, k0, BLOCK_K: tl.constexpr, ROW_BYTES: tl.constexpr,
                        CODE_BYTES: tl.constexpr, EVICT: tl.constexpr):
        """The codes [R, BLOCK_K] (uint8) of rows [R] (ROW_BYTES apart), columns k0 .. k0 + BLOCK_K - 1,
        0 past the row's CODE_BYTES: a tile's bytes read in one run each, each byte's two joined."""
        byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        packed = tl.load(w_ptr + rows[:, None] * ROW_BYTES + byte[None, :],
                         mask=row_ok[:, None] & (byte < CODE_BYTES)[None, :], other=0,
                         eviction_policy=EVICT)  # [R, BLOCK_K / 2]
        return tl.reshape(tl.join(packed & 0xF, packed >> 4), (rows.shape[0], BLOCK_K))

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr, G: tl.constexpr):
        # BLOCK_K even and k0 a multiple of it: the tile's bytes are whole. BLOCK_K and G are powers
        # of two, so a tile lies in one group or holds whole groups: scales and zeros load per group.
        CODE_BYTES: tl.constexpr = K // 2
        NG: tl.constexpr = K // G  # groups per row
        ROW_BYTES: tl.constexpr = CODE_BYTES + ((NG + 1) // 2 + 15) // 16 * 16  # data_cols: codes, zeros
        R: tl.constexpr = rows.shape[0]
        q = _codes_in_order(w_ptr, rows, row_ok, k0, BLOCK_K, ROW_BYTES, CODE_BYTES, EVICT).to(tl.float32)
        zero_ptr = w_ptr + rows * ROW_BYTES + CODE_BYTES  # [R] each row's zero bytes
        if G % BLOCK_K == 0:  # the tile lies in one group: one scale and zero per row
            s, z = _scales_zeros(s_ptr, zero_ptr, rows, row_ok, k0 // G + tl.arange(0, 1), NG)  # [R, 1]
            w = (q - z) * s
        else:  # the tile holds whole groups (past K: masked, its codes, scales and zeros 0)
            s, z = _scales_zeros(s_ptr, zero_ptr, rows, row_ok, k0 // G + tl.arange(0, BLOCK_K // G), NG)
            centred = tl.reshape(q, (R, BLOCK_K // G, G)) - z[:, :, None]  # [R, BLOCK_K / G, G]
            w = tl.reshape(centred * s[:, :, None], (R, BLOCK_K))
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w

    # the entry points ExpertFormat.triton_load names: _load with the group size as a literal
    @triton.jit
    def _load_g32(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                  EVICT: tl.constexpr):
        return _load(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 32)

    @triton.jit
    def _load_g64(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                  EVICT: tl.constexpr):
        return _load(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 64)

    @triton.jit
    def _load_g128(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 128)

    _LOADS = {32: _load_g32, 64: _load_g64, 128: _load_g128}

    @triton.jit
    def _scales_zeros(s_ptr, zero_ptr, rows, row_ok, group, NG: tl.constexpr):
        """The scales and zero points [R, n] (fp32) of groups [n] of each row (zero_ptr [R]: where its
        zero bytes start); 0 past the row's NG groups."""
        mask = row_ok[:, None] & (group < NG)[None, :]
        s = tl.load(s_ptr + rows[:, None] * NG + group[None, :], mask=mask, other=0.0)
        z = (tl.load(zero_ptr[:, None] + (group // 2)[None, :], mask=mask, other=0) >> (4 * (group % 2))[None, :]) & 0xF
        return s.to(tl.float32), z.to(tl.float32)

    @triton.jit
    def _dot(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr, G: tl.constexpr):
        """The rows' dot products with v over one tile (base.ExpertFormat.triton_dot): where the tile
        holds whole groups, int4.nibble_group_sums over the codes' words and, per group and row,
        s (sum(q v) - z sum(v)); a tile inside one group decodes (_load) and multiplies in order."""
        if BLOCK_K % G == 0:
            CODE_BYTES: tl.constexpr = K // 2
            NG: tl.constexpr = K // G
            ROW_BYTES: tl.constexpr = CODE_BYTES + ((NG + 1) // 2 + 15) // 16 * 16  # data_cols: 16-aligned
            per_group, v_group = nibble_group_sums(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, ROW_BYTES // 4, G)
            s, z = _scales_zeros(s_ptr, w_ptr + rows * ROW_BYTES + CODE_BYTES, rows, row_ok,
                                 k0 // G + tl.arange(0, BLOCK_K // G), NG)  # [R, BLOCK_K / G]
            return tl.sum((per_group - z * v_group[None, :]) * s, axis=1)
        else:
            w = _load(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, False, "evict_first", G)
            return in_order_dot(w, v_ptr, k0, K, BLOCK_K)

    # the entry points ExpertFormat.triton_dot names, as _LOADS'
    @triton.jit
    def _dot_g32(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 32)

    @triton.jit
    def _dot_g64(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 64)

    @triton.jit
    def _dot_g128(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 128)

    _DOTS = {32: _dot_g32, 64: _dot_g64, 128: _dot_g128}

    @triton.jit
    def _codes(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr,
               G: tl.constexpr):
        """base.ExpertFormat.triton_codes_for's tile (inside one group): the codes n as DTYPE's 2**e + n
        (bf16 128 + n, fp16 1024 + n: exact, whole numbers where the float's step is 1), each OR'd into
        2**e's bits, [BLOCK_K, R]; the group's scales [R]; its zero points plus 2**e [R]. In the grouped
        gate/up kernel's sm_90 SASS 6.9 loop instructions a weight against 8.0 decoding each weight into
        a float, and a Mixtral-size 32-token layer call 0.834 -> 0.702 ms on an H200, its error against
        fp32 math 3.9e-3 -> 2.9e-3 of the largest output (no weight rounded to bf16;
        bench/results/quant/quant_experts-h200-byte-codes.json). int4's tiles decoded the same way (5.9
        instructions a weight against 7.7) took 0.559 -> 0.602 ms there, so int4 keeps its decoded tiles;
        codes from 32-bit words, two nibbles an instruction, took 1.6x as long: the compiler pipelines a
        tile's bytes through shared memory, but not the words."""
        MAGIC: tl.constexpr = 0x4300 if DTYPE == tl.bfloat16 else 0x6400  # the bits of 128 (bf16), 1024 (fp16)
        OFFSET: tl.constexpr = 128.0 if DTYPE == tl.bfloat16 else 1024.0
        CODE_BYTES: tl.constexpr = K // 2
        NG: tl.constexpr = K // G
        ROW_BYTES: tl.constexpr = CODE_BYTES + ((NG + 1) // 2 + 15) // 16 * 16  # data_cols: 16-aligned
        R: tl.constexpr = rows.shape[0]
        codes = _codes_in_order(w_ptr, rows, row_ok, k0, BLOCK_K, ROW_BYTES, CODE_BYTES, "").to(tl.int16) | MAGIC
        s, z = _scales_zeros(s_ptr, w_ptr + rows * ROW_BYTES + CODE_BYTES, rows, row_ok, k0 // G + tl.arange(0, 1),
                             NG)  # [R, 1]
        return tl.trans(codes.to(DTYPE, bitcast=True)), tl.reshape(s, (R,)), tl.reshape(z, (R,)) + OFFSET

    # the entry points ExpertFormat.triton_codes_for names, as _LOADS'
    @triton.jit
    def _codes_g32(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
        return _codes(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, DTYPE, 32)

    @triton.jit
    def _codes_g64(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
        return _codes(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, DTYPE, 64)

    @triton.jit
    def _codes_g128(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, DTYPE: tl.constexpr):
        return _codes(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, DTYPE, 128)

    _CODES = {32: _codes_g32, 64: _codes_g64, 128: _codes_g128}
