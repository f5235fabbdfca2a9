"""The k-quants (GGUF Q2_K to Q6_K; --expert-quant q2_k ... q6_k): super-blocks of 256 weights along
K, each with an fp16 scale d whose multiples scale its sub-blocks. One file because the five share
the super-block, Q4_K and Q5_K everything but Q5_K's fifth bit, Q2_K and Q3_K their 2-bit planes.
Q2_K and Q3_K (the types of the largest MoE files, and of Q3_K_M's gate/up) are laid out in their
classes' docstrings.

Q4_K (144 bytes, 4.5 bits per weight) and Q5_K (176 bytes, 5.5 bits): d, dmin (fp16), then 12
bytes of eight 6-bit (scale, min) pairs, one per sub-block of 32, then for Q5_K 32 bytes `qh` whose
bit i of byte l is the high bit of weight 32 i + l, then 128 bytes `qs`: byte 32 c + l holds weight
64 c + l in its low nibble and 64 c + 32 + l in its high one. w = d * scale * q - dmin * min.
The 12 bytes: bytes 0-3 scale[0-3] | scale[4-7] >> 4 << 6, bytes 4-7 min[0-3] | min[4-7] >> 4 << 6,
bytes 8-11 scale[4-7] & 15 | (min[4-7] & 15) << 4.

Q6_K (210 bytes, 6.5625 bits): ql (128 bytes), qh (64), sixteen int8 scales (one per sub-block of
16), d. Each half n of 128 weights uses ql[64 n:], qh[32 n:]: weight 128 n + 32 j + l has the
nibble (j // 2: high, else low) of ql[64 n + 32 (j % 2) + l] and bits 2 j, 2 j + 1 of qh[32 n + l]
as its high two; w = d * scale * (q - 32).

Decoding is llama.cpp's, bit for bit (the tests hold it to the gguf package's). Encoding, for
--expert-quant and the tests, is a plain round-to-nearest: each sub-block's range (Q2_K, Q4_K, Q5_K:
min..max, the min clamped to <= 0; Q6_K: +-absmax; Q3_K: see there) over the codes, the sub-block
scales then rounded to 4 (Q2_K), 6 or 8 (Q6_K) bits against d = their max / 15, 63 (31 for Q3_K's
signed ones) or 127. It is not llama.cpp's quantizer, which
searches each sub-block's scale and min for the least squared error (and weighs by an importance
matrix when given one): files from llama-quantize are a little more accurate than ours.
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
)

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.base import SUM_SCALE, byte_code_products, code_dot, in_order_dot
    from moe_serve.engine.experts.formats.ggml_block import (
        FP16,
        block_runs,
        block_tile,
        interleaved_cols,
        vector_runs,
    )
except ImportError:  # no triton: only the torch path decodes
    triton = None

SUPER_BLOCK = 256  # also written in the loads below, as the block sizes and offsets
_HEADER = 16  # Q4_K / Q5_K: d, dmin, 12 bytes of scales and mins


def _codes(x: torch.Tensor, step: torch.Tensor, qmax: int, qmin: int = 0) -> torch.Tensor:
    """round(x / step) clamped to [qmin, qmax]; 0 where the step is 0 (an all-zero range). Q3_K's steps
    may be negative."""
    return torch.where(step != 0, x / step, 0.0).round_().clamp_(qmin, qmax)


def _pack_scales_mins(scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins [..., 8] -> the 12 bytes of Q4_K and Q5_K."""
    sc, m = scales.to(torch.uint8), mins.to(torch.uint8)
    return torch.cat((sc[..., :4] | (sc[..., 4:] >> 4 << 6), m[..., :4] | (m[..., 4:] >> 4 << 6),
                      nibbles(sc[..., 4:], m[..., 4:])), dim=-1)


def _unpack_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 bytes [..., 12] -> scales, mins [..., 8] as fp32."""
    b = packed.to(torch.int32)
    low, high, extra = b[..., 0:4], b[..., 4:8], b[..., 8:12]
    scales = torch.cat((low & 63, (extra & 15) | (low >> 6 << 4)), dim=-1)
    mins = torch.cat((high & 63, (extra >> 4) | (high >> 6 << 4)), dim=-1)
    return scales.float(), mins.float()


@dataclass(frozen=True)
class _WithMin(GgmlBlockFormat):
    """Q4_K and Q5_K: `bits`-bit codes over each sub-block's min..max."""
    bits: ClassVar[int]
    block: ClassVar[int] = SUPER_BLOCK
    col_multiple: ClassVar[int] = SUPER_BLOCK

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        qmax = 2**self.bits - 1
        sub = w.unflatten(-1, (8, 32))  # [..., 8, 32]
        low = sub.amin(-1).clamp(max=0.0)  # [..., 8] stored as a min >= 0 to subtract
        ranges, mins = divide(sub.amax(-1) - low, qmax), -low
        d = divide(ranges.amax(-1), 63).half().float()  # [...]
        dmin = divide(mins.amax(-1), 63).half().float()
        scales, min_codes = _codes(ranges, d[..., None], 63), _codes(mins, dmin[..., None], 63)  # [..., 8]
        step, offset = (d[..., None] * scales)[..., None], (dmin[..., None] * min_codes)[..., None]
        q = _codes(sub + offset, step, qmax).to(torch.uint8)  # [..., 8, 32]
        fields = [fp16_bytes(d), fp16_bytes(dmin), _pack_scales_mins(scales, min_codes)]
        if self.bits == 5:
            fields.append(sum((q[..., i, :] >> 4 & 1) << i for i in range(8)).to(torch.uint8))  # qh [..., 32]
        fields.append(nibbles(q[..., 0::2, :], q[..., 1::2, :]).flatten(-2))  # qs [..., 128]
        return torch.cat(fields, dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        scales, mins = _unpack_scales_mins(blocks[..., 4:_HEADER])  # [..., 8]
        qs_at = _HEADER + (32 if self.bits == 5 else 0)
        qs = blocks[..., qs_at : qs_at + 128].to(torch.int32).unflatten(-1, (4, 32))  # [..., 4, 32]
        q = torch.stack((qs & 15, qs >> 4), dim=-2).flatten(-3, -2)  # [..., 8, 32] sub-blocks in order
        if self.bits == 5:
            qh = blocks[..., _HEADER : _HEADER + 32].to(torch.int32)  # [..., 32]
            q = q | ((qh[..., None, :] >> torch.arange(8, device=qh.device)[:, None] & 1) << 4)
        step = (fp16_field(blocks, 0)[..., None] * scales)[..., None]  # [..., 8, 1]
        offset = (fp16_field(blocks, 2)[..., None] * mins)[..., None]
        return (step * q.float() - offset).flatten(-2)


@dataclass(frozen=True)
class Q4_K(_WithMin):
    name: ClassVar[str] = "q4_k"
    ggml_type: ClassVar[str] = "Q4_K"
    block_bytes: ClassVar[int] = 144
    bits: ClassVar[int] = 4

    @property
    def triton_load(self) -> Any:
        return _load_q4_k

    @property
    def triton_dot(self) -> Any:
        return _dot_q4_k

    @property
    def triton_cols(self) -> Any:
        return _q4_k_cols


@dataclass(frozen=True)
class Q5_K(_WithMin):
    name: ClassVar[str] = "q5_k"
    ggml_type: ClassVar[str] = "Q5_K"
    block_bytes: ClassVar[int] = 176
    bits: ClassVar[int] = 5

    @property
    def triton_load(self) -> Any:
        return _load_q5_k

    @property
    def triton_dot(self) -> Any:
        return _dot_q5_k

    @property
    def triton_cols(self) -> Any:
        return _q4_k_cols


def _two_bit_planes(q: torch.Tensor) -> torch.Tensor:
    """Codes [..., 256] of 0..3 -> Q2_K's and Q3_K's 64 bytes: weight 128 n + 32 j + l in bits 2 j
    of byte 32 n + l."""
    planes = q.to(torch.int32).unflatten(-1, (2, 4, 32))  # [..., n, j, l]
    return (planes << 2 * torch.arange(4, device=q.device)[:, None]).sum(-2).to(torch.uint8).flatten(-2)


def _from_two_bit_planes(qs: torch.Tensor) -> torch.Tensor:
    """The 64 bytes [..., 64] -> codes [..., 16, 16] by sub-block (the inverse of _two_bit_planes)."""
    planes = qs.to(torch.int32).unflatten(-1, (2, 1, 32)) >> 2 * torch.arange(4, device=qs.device)[:, None] & 3
    return planes.flatten(-3).unflatten(-1, (16, 16))  # [..., n, j, l] in weight order


@dataclass(frozen=True)
class Q2_K(GgmlBlockFormat):
    """84 bytes, 2.625 bits per weight: sixteen scale bytes (a sub-block of 16's 4-bit scale in the low
    nibble, its 4-bit min in the high one), 64 bytes of 2-bit codes (_two_bit_planes), d, dmin.
    w = d * scale * q - dmin * min."""

    name: ClassVar[str] = "q2_k"
    ggml_type: ClassVar[str] = "Q2_K"
    block: ClassVar[int] = SUPER_BLOCK
    block_bytes: ClassVar[int] = 84
    col_multiple: ClassVar[int] = SUPER_BLOCK

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        sub = w.unflatten(-1, (16, 16))  # [..., 16, 16]
        low = sub.amin(-1).clamp(max=0.0)  # [..., 16] stored as a min >= 0 to subtract
        ranges, mins = divide(sub.amax(-1) - low, 3), -low
        d = divide(ranges.amax(-1), 15).half().float()  # [...]
        dmin = divide(mins.amax(-1), 15).half().float()
        scales, min_codes = _codes(ranges, d[..., None], 15), _codes(mins, dmin[..., None], 15)  # [..., 16]
        step, offset = (d[..., None] * scales)[..., None], (dmin[..., None] * min_codes)[..., None]
        q = _codes(sub + offset, step, 3).flatten(-2)  # [..., 256]
        return torch.cat((nibbles(scales, min_codes), _two_bit_planes(q), fp16_bytes(d), fp16_bytes(dmin)), dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        packed = blocks[..., :16].to(torch.int32)  # [..., 16]
        step = fp16_field(blocks, 80)[..., None] * (packed & 15).float()
        offset = fp16_field(blocks, 82)[..., None] * (packed >> 4).float()
        q = _from_two_bit_planes(blocks[..., 16:80])  # [..., 16, 16]
        return (step[..., None] * q.float() - offset[..., None]).flatten(-2)

    @property
    def triton_load(self) -> Any:
        return _load_q2_k

    @property
    def triton_dot(self) -> Any:
        return _dot_q2_k

    @property
    def triton_cols(self) -> Any:
        return _planes_cols


@dataclass(frozen=True)
class Q3_K(GgmlBlockFormat):
    """110 bytes, 3.4375 bits per weight: 32 bytes hmask (bit 4 n + j of byte l: weight 128 n + 32 j + l's
    third bit), 64 bytes of its low two bits (_two_bit_planes), twelve bytes of sixteen 6-bit scales
    (scale i's low nibble in byte i % 8 at bit 4 (i // 8), its high two bits in byte 8 + i % 4 at bit
    2 (i // 4)), d. w = d * (scale - 32) * (q - 4), q the three bits (the stored third bit is set
    for q >= 4).

    The encoder takes each sub-block's step from its weight of largest magnitude, sign kept, over
    the code -4 (as Q4_0 does), so that weight is exact; scales are signed."""

    name: ClassVar[str] = "q3_k"
    ggml_type: ClassVar[str] = "Q3_K"
    block: ClassVar[int] = SUPER_BLOCK
    block_bytes: ClassVar[int] = 110
    col_multiple: ClassVar[int] = SUPER_BLOCK

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        sub = w.unflatten(-1, (16, 16))  # [..., 16, 16]
        steps = sub.gather(-1, sub.abs().argmax(-1, keepdim=True))[..., 0] / -4  # [..., 16]
        d = divide(steps.abs().amax(-1), 31).half().float()  # [...]
        scales = _codes(steps, d[..., None], 31, -31)  # [..., 16]
        q = (_codes(sub, (d[..., None] * scales)[..., None], 3, -4) + 4).to(torch.int32).flatten(-2)  # [..., 256] 0..7
        high = (q >> 2).unflatten(-1, (8, 32))  # [..., 4 n + j, l]
        hmask = (high << torch.arange(8, device=w.device)[:, None]).sum(-2).to(torch.uint8)  # [..., 32]
        codes = (scales + 32).to(torch.int32)  # [..., 16] 1..63
        low = codes & 15
        high_bits = codes >> 4
        packed = torch.cat((low[..., :8] | (low[..., 8:] << 4),
                            high_bits[..., 0:4] | (high_bits[..., 4:8] << 2) | (high_bits[..., 8:12] << 4)
                            | (high_bits[..., 12:16] << 6)), dim=-1).to(torch.uint8)  # [..., 12]
        return torch.cat((hmask, _two_bit_planes(q & 3), packed, fp16_bytes(d)), dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        packed = blocks[..., 96:108].to(torch.int32)
        low = torch.cat((packed[..., :8] & 15, packed[..., :8] >> 4), dim=-1)  # [..., 16]
        high = packed[..., 8:12, None] >> 2 * torch.arange(4, device=blocks.device) & 3  # [..., i % 4, i // 4]
        scales = (low | high.transpose(-1, -2).flatten(-2) << 4) - 32
        hmask = blocks[..., :32].to(torch.int32)[..., None, :] >> torch.arange(8, device=blocks.device)[:, None] & 1
        third = hmask.unflatten(-2, (2, 4)).flatten(-3).unflatten(-1, (16, 16))  # [..., 16, 16] as the codes
        q = _from_two_bit_planes(blocks[..., 32:96]) - 4 * (1 - third)
        step = fp16_field(blocks, 108)[..., None] * scales.float()  # [..., 16]
        return (step[..., None] * q.float()).flatten(-2)

    @property
    def triton_load(self) -> Any:
        return _load_q3_k

    @property
    def triton_dot(self) -> Any:
        return _dot_q3_k

    @property
    def triton_cols(self) -> Any:
        return _planes_cols


@dataclass(frozen=True)
class Q6_K(GgmlBlockFormat):
    name: ClassVar[str] = "q6_k"
    ggml_type: ClassVar[str] = "Q6_K"
    block: ClassVar[int] = SUPER_BLOCK
    block_bytes: ClassVar[int] = 210
    col_multiple: ClassVar[int] = SUPER_BLOCK

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        sub = w.unflatten(-1, (16, 16))  # [..., 16, 16]
        ranges = divide(sub.abs().amax(-1), 31)  # [..., 16]: +-absmax on codes -31..31 of -32..31
        d = divide(ranges.amax(-1), 127).half().float()  # [...]
        scales = _codes(ranges, d[..., None], 127)  # [..., 16]
        q = (_codes(sub, (d[..., None] * scales)[..., None], 31, -32) + 32).to(torch.uint8)  # [..., 16, 16]
        q = q.flatten(-2).unflatten(-1, (2, 4, 32))  # [..., half, j, l]
        ql = torch.cat((nibbles(q[..., 0, :], q[..., 2, :]), nibbles(q[..., 1, :], q[..., 3, :])), dim=-1)
        qh = sum((q[..., j, :] >> 4 & 3) << 2 * j for j in range(4)).to(torch.uint8)  # [..., half, 32]
        return torch.cat((ql.flatten(-2), qh.flatten(-2), scales.to(torch.int8).view(torch.uint8), fp16_bytes(d)),
                         dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        ql = blocks[..., :128].to(torch.int32).unflatten(-1, (2, 2, 32))  # [..., half, j % 2, l]
        qh = blocks[..., 128:192].to(torch.int32).unflatten(-1, (2, 1, 32))  # [..., half, 1, l]
        low = torch.cat((ql & 15, ql >> 4), dim=-2)  # [..., half, j, l]
        high = qh >> 2 * torch.arange(4, device=qh.device)[:, None] & 3
        q = ((low | high << 4) - 32).flatten(-3).unflatten(-1, (16, 16))  # [..., 16, 16]
        step = fp16_field(blocks, 208)[..., None] * blocks[..., 192:208].view(torch.int8).float()  # [..., 16]
        return (step[..., None] * q.float()).flatten(-2)

    @property
    def triton_load(self) -> Any:
        return _load_q6_k

    @property
    def triton_dot(self) -> Any:
        return _dot_q6_k

    @property
    def triton_cols(self) -> Any:
        return _planes_cols


if triton is not None:
    # Every type reads runs of bytes contiguously where a tile holds whole runs (interleaved_cols):
    # Q2_K, Q3_K and Q6_K a half super-block's runs of 32 bytes (2-bit planes, hmask; ql, qh), Q4_K and
    # Q5_K a chunk's 32 bytes of nibbles. A narrower tile gathers each weight's bytes by its column, in order.

    @triton.jit
    def _fp16_pair(word):
        """The two fp16 of a little-endian 32-bit word (int32), as fp32: the low half's, the high half's."""
        low = (word & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        high = ((word >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        return low, high

    @triton.jit
    def _scale_min(block, sub, mask):
        """Q4_K/Q5_K: the step d * scale and offset dmin * min of sub-block `sub` (0..7, any shape that
        broadcasts with the block pointers `block`), as fp32, from the super-block's 16-byte head read
        as four aligned 32-bit words (144- and 176-byte blocks, sections 16-aligned): d | dmin << 16,
        then the 12 scale bytes. Fewer load instructions than a byte each: a chunk's 32 bytes of codes
        take two 16-byte loads, so bytes of scales loaded apart would outnumber them."""
        words = block.to(tl.pointer_type(tl.int32))
        head = tl.load(words, mask=mask, other=0)
        t = 8 * (sub & 3)  # the byte's bits in its word
        first = (tl.load(words + 1, mask=mask, other=0) >> t) & 255  # scale byte sub % 4
        second = (tl.load(words + 2, mask=mask, other=0) >> t) & 255  # scale byte 4 + sub % 4
        third = (tl.load(words + 3, mask=mask, other=0) >> t) & 255  # scale byte 8 + sub % 4
        scale = tl.where(sub < 4, first & 63, (third & 15) | ((first >> 6) << 4))
        low = tl.where(sub < 4, second & 63, (third >> 4) | ((second >> 6) << 4))
        d, dmin = _fp16_pair(head)
        return d * scale.to(tl.float32), dmin * low.to(tl.float32)

    @triton.jit
    def _chunks_with_min(w_ptr, rows, row_ok, k0, K: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr,
                         HIGH_BIT: tl.constexpr):
        """Q4_K/Q5_K's C chunks of 64 columns from k0 (a multiple of 64), each chunk's 32 bytes of qs read
        contiguously: qs byte 32 c + l holds weight 64 c + l (sub-block 2 c) in its low nibble and
        64 c + 32 + l (sub-block 2 c + 1) in its high one. Returns the codes of the low and high
        nibbles [R, C, 32] (int32), each one's step and offset [R, C], the chunks [C] and the mask [R, C]."""
        BYTES: tl.constexpr = 176 if HIGH_BIT else 144
        QS: tl.constexpr = 48 if HIGH_BIT else 16
        chunk, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, C, 64, 256, BYTES)  # [C], [R, C], [R, C]
        c = chunk % 4  # [C] the chunk in its super-block
        lane = tl.arange(0, 32)
        packed = tl.load(block[:, :, None] + (QS + 32 * c)[None, :, None] + lane[None, None, :],
                         mask=mask[:, :, None], other=0, eviction_policy=EVICT).to(tl.int32)  # [R, C, 32]
        low, high = packed & 15, packed >> 4
        if HIGH_BIT:  # bit i of qh[l]: weight 32 i + l's fifth
            qh = tl.load(block[:, :, None] + 16 + lane[None, None, :], mask=mask[:, :, None], other=0,
                         eviction_policy=EVICT).to(tl.int32) >> (2 * c)[None, :, None]
            low, high = low | ((qh & 1) << 4), high | ((qh & 2) << 3)
        step_low, offset_low = _scale_min(block, (2 * c)[None, :], mask)  # [R, C]
        step_high, offset_high = _scale_min(block, (2 * c + 1)[None, :], mask)
        return low, high, step_low, offset_low, step_high, offset_high, chunk, mask

    @triton.jit
    def _narrow_with_min(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr,
                         HIGH_BIT: tl.constexpr):
        """Q4_K/Q5_K's columns k0 .. k0 + BLOCK_K (<= 32) of sub-block (k0 / 32) % 8, in order: [R, BLOCK_K]."""
        BYTES: tl.constexpr = 176 if HIGH_BIT else 144
        QS: tl.constexpr = 48 if HIGH_BIT else 16
        sub = k0 // 32 % 8
        block = w_ptr + rows[:, None] * (K // 256 * BYTES) + k0 // 256 * BYTES  # [R, 1]
        place = k0 % 32 + tl.arange(0, BLOCK_K)  # [BLOCK_K] the lane
        packed = tl.load(block + (QS + 32 * (sub // 2) + place)[None, :], mask=row_ok[:, None], other=0,
                         eviction_policy=EVICT)  # [R, BLOCK_K]
        q = (packed >> (4 * (sub % 2))) & 15
        if HIGH_BIT:
            qh = tl.load(block + (16 + place)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
            q = q | (((qh >> sub) & 1) << 4)
        step, offset = _scale_min(block, sub, row_ok[:, None])  # [R, 1]
        return q.to(tl.float32) * step - offset

    @triton.jit
    def _load_with_min(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                       EVICT: tl.constexpr, HIGH_BIT: tl.constexpr):
        """In interleaved_cols' order (SPAN 32, WAYS 2): a tile of whole chunks joins each byte's two weights."""
        R: tl.constexpr = rows.shape[0]
        if BLOCK_K >= 64:
            low, high, step_low, offset_low, step_high, offset_high, _, _ = _chunks_with_min(
                w_ptr, rows, row_ok, k0, K, BLOCK_K // 64, EVICT, HIGH_BIT)
            w = tl.join(low.to(tl.float32) * step_low[:, :, None] - offset_low[:, :, None],
                        high.to(tl.float32) * step_high[:, :, None] - offset_high[:, :, None])  # [R, C, 32, 2]
            w = tl.reshape(w, (R, BLOCK_K))
        else:
            w = _narrow_with_min(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT, HIGH_BIT)
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w

    @triton.jit
    def _dot_with_min(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr,
                      HIGH_BIT: tl.constexpr):
        """The rows' dot products with v over one tile (base.ExpertFormat.triton_dot) from the chunks as
        read, no weight joined back: per chunk and nibble, sum(q v) times the step less sum(v) times the
        offset. Q4_K's codes come from _chunks_with_min's bytes (base.code_dot). Q5_K reads a chunk's
        32 bytes of qs (48-byte aligned in the block) and the super-block's 32 of qh as eight 32-bit
        words each, ORs the fifth bits (bit 2 c and 2 c + 1 of qh byte m) in above each byte's nibble, a
        word's four at once, and sums the 5-bit codes in place (base.byte_code_products): 8.54 -> 5.73 loop
        instructions a weight in the one-token gate/up kernel's sm_90 SASS (bench/kernel_sass.py), a
        Mixtral-size layer call 0.213 -> 0.188 ms on an H200 (bench/results/quant/quant_experts-h200-words-codes.json).
        Q4_K's words (5.34 -> 4.32 instructions a weight) took 0.153 -> 0.158 ms there, so it keeps its bytes.
        (The GEMV summing the joined tiles of 8 chunks or more across its loop gave wrong sums on an
        H200 with Triton 3.6, where each tile's own products were right.)"""
        if BLOCK_K >= 64:
            C: tl.constexpr = BLOCK_K // 64
            if HIGH_BIT:
                chunk, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, C, 64, 256, 176)  # [C], [R, C], [R, C]
                c = chunk % 4  # [C] the chunk in its super-block
                word = tl.arange(0, 8)[None, None, :]
                qs = tl.load((block + (48 + 32 * c)[None, :]).to(tl.pointer_type(tl.int32))[:, :, None] + word,
                             mask=mask[:, :, None], other=0, eviction_policy="evict_first")  # [R, C, 8]
                qh = tl.load((block + 16).to(tl.pointer_type(tl.int32))[:, :, None] + word, mask=mask[:, :, None],
                             other=0, eviction_policy="evict_first") >> (2 * c)[None, :, None]  # [R, C, 8]
                low = (qs & 0x0F0F0F0F) | ((qh & 0x01010101) << 4)
                high = ((qs >> 4) & 0x0F0F0F0F) | (((qh >> 1) & 0x01010101) << 4)
                step_low, offset_low = _scale_min(block, (2 * c)[None, :], mask)  # [R, C]
                step_high, offset_high = _scale_min(block, (2 * c + 1)[None, :], mask)
            else:
                low, high, step_low, offset_low, step_high, offset_high, chunk, _ = _chunks_with_min(
                    w_ptr, rows, row_ok, k0, K, C, "evict_first", False)
            v_low, v_high = vector_runs(v_ptr, chunk, K, 64, 32), vector_runs(v_ptr + 32, chunk, K, 64, 32)  # [C, 32]
            if HIGH_BIT:
                # [R, C]: byte b of word w meets the run's element 4 w + b
                qv_low = tl.sum(byte_code_products(low, 31, 0, tl.reshape(v_low, (C, 8, 4))), axis=2) * SUM_SCALE
                qv_high = tl.sum(byte_code_products(high, 31, 0, tl.reshape(v_high, (C, 8, 4))), axis=2) * SUM_SCALE
            else:
                qv_low, qv_high = code_dot(low, v_low[None, :, :], 2), code_dot(high, v_high[None, :, :], 2)
            return tl.sum(step_low * qv_low - offset_low * tl.sum(v_low, axis=1)[None, :]
                          + step_high * qv_high - offset_high * tl.sum(v_high, axis=1)[None, :], axis=1)
        else:
            w = _narrow_with_min(w_ptr, rows, row_ok, k0, K, BLOCK_K, "evict_first", HIGH_BIT)
            return in_order_dot(w, v_ptr, k0, K, BLOCK_K)

    @triton.jit
    def _q4_k_cols(k0, BLOCK_K: tl.constexpr):
        return interleaved_cols(k0, BLOCK_K, 32, 2)

    @triton.jit
    def _load_q4_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_with_min(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, False)

    @triton.jit
    def _load_q5_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_with_min(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, True)

    @triton.jit
    def _dot_q4_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_with_min(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, False)

    @triton.jit
    def _dot_q5_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_with_min(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, True)

    @triton.jit
    def _q2_k_step_offset(block, sub, mask):
        """Q2_K: the step d * scale and offset dmin * min of sub-block `sub` (0..15, broadcasting with the
        block pointers `block`), fp32; d and dmin read as one aligned 32-bit word (84-byte blocks)."""
        scale = tl.load(block + sub, mask=mask, other=0).to(tl.int32)
        d, dmin = _fp16_pair(tl.load((block + 80).to(tl.pointer_type(tl.int32)), mask=mask, other=0))
        return d * (scale & 15).to(tl.float32), dmin * (scale >> 4).to(tl.float32)

    @triton.jit
    def _q3_k_step(block, sub, mask):
        """Q3_K: the step d * (scale - 32) of sub-block `sub` (0..15, broadcasting with `block`), fp32."""
        low = (tl.load(block + (96 + (sub & 7)), mask=mask, other=0).to(tl.int32) >> ((sub >> 3) << 2)) & 15
        high = (tl.load(block + (104 + (sub & 3)), mask=mask, other=0).to(tl.int32) >> ((sub >> 2) << 1)) & 3
        d = tl.load((block + 108).to(FP16), mask=mask, other=0.0).to(tl.float32)
        return d * ((low | (high << 4)) - 32).to(tl.float32)

    @triton.jit
    def _q6_k_step(block, sub, mask):
        """Q6_K: the step d * scale of sub-block `sub` (0..15, broadcasting with `block`), fp32."""
        scale = tl.load(block + (192 + sub), mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
        return tl.load((block + 208).to(FP16), mask=mask, other=0.0).to(tl.float32) * scale

    @triton.jit
    def _gathered_q2_k(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
        """Columns k0 .. k0 + BLOCK_K (< 128: one plane of one half) in order, gathered by column."""
        G: tl.constexpr = 16 if BLOCK_K > 16 else BLOCK_K
        R: tl.constexpr = rows.shape[0]
        block, place, mask, group, first, group_mask = block_tile(w_ptr, rows, row_ok, k0, K, BLOCK_K, 256, 84, G)
        # weight p = 128 n + 32 j + l: bits 2 j of qs[32 n + l]
        packed = tl.load(block + (16 + ((place >> 7) << 5) + (place & 31)), mask=mask, other=0,
                         eviction_policy=EVICT).to(tl.int32)
        q = (packed >> (((place >> 5) & 3) << 1)) & 3  # [R, BLOCK_K]
        step, offset = _q2_k_step_offset(group, first >> 4, group_mask)  # [R, BLOCK_K / G]
        w = tl.reshape(q.to(tl.float32), (R, BLOCK_K // G, G)) * step[:, :, None] - offset[:, :, None]
        return tl.reshape(w, (R, BLOCK_K))

    @triton.jit
    def _gathered_q3_k(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
        """Columns k0 .. k0 + BLOCK_K (< 128: one plane of one half) in order, gathered by column."""
        G: tl.constexpr = 16 if BLOCK_K > 16 else BLOCK_K
        R: tl.constexpr = rows.shape[0]
        block, place, mask, group, first, group_mask = block_tile(w_ptr, rows, row_ok, k0, K, BLOCK_K, 256, 110, G)
        # weight p = 128 n + 32 j + l: bits 2 j of qs[32 n + l], its third bit bit 4 n + j of hmask[l]
        lane, plane = place & 31, (place >> 5) & 3
        packed = tl.load(block + (32 + ((place >> 7) << 5) + lane), mask=mask, other=0,
                         eviction_policy=EVICT).to(tl.int32)
        hmask = tl.load(block + lane, mask=mask, other=0, eviction_policy=EVICT).to(tl.int32)
        third = (hmask >> (((place >> 7) << 2) + plane)) & 1
        q = ((packed >> (plane << 1)) & 3) - ((1 - third) << 2)  # [R, BLOCK_K] -4..3
        step = _q3_k_step(group, first >> 4, group_mask)  # [R, BLOCK_K / G]
        w = tl.reshape(q.to(tl.float32), (R, BLOCK_K // G, G)) * step[:, :, None]
        return tl.reshape(w, (R, BLOCK_K))

    @triton.jit
    def _planes_cols(k0, BLOCK_K: tl.constexpr):
        return interleaved_cols(k0, BLOCK_K, 32, 4)

    @triton.jit
    def _halves(w_ptr, rows, row_ok, k0, K: tl.constexpr, HALVES: tl.constexpr, EVICT: tl.constexpr,
                BITS: tl.constexpr):
        """The HALVES halves of 128 weights from k0 (a multiple of 128) of Q2_K, Q3_K or Q6_K (BITS 2, 3,
        6), each half's bytes read in runs of 32: weight 128 n + 32 j + l (half n, plane j) has its
        bits in byte l of each run. Returns three runs [R, HALVES, 32] (int32): Q2_K's and Q3_K's 2-bit
        planes (bits 2 j), Q3_K's hmask shifted to the half (bit j: the third bit), and the 2-bit
        planes again; Q6_K's ql[64 n + l] (planes 0 and 2: low and high nibble), qh[32 n + l] (bits
        2 j, 2 j + 1: the top two) and ql[64 n + 32 + l] (planes 1 and 3). Then the super-blocks [R,
        HALVES], the halves [HALVES] and the mask [R, HALVES]."""
        BYTES: tl.constexpr = 84 if BITS == 2 else (110 if BITS == 3 else 210)
        half, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, HALVES, 128, 256, BYTES)  # [HALVES], [R, HALVES]
        n = (half % 2)[None, :, None]
        at = block[:, :, None] + tl.arange(0, 32)[None, None, :]  # [R, HALVES, 32]
        run_mask = mask[:, :, None]
        if BITS == 6:
            first = tl.load(at + 64 * n, mask=run_mask, other=0, eviction_policy=EVICT).to(tl.int32)
            second = tl.load(at + 128 + 32 * n, mask=run_mask, other=0, eviction_policy=EVICT).to(tl.int32)
            third = tl.load(at + 64 * n + 32, mask=run_mask, other=0, eviction_policy=EVICT).to(tl.int32)
        else:
            first = tl.load(at + (32 if BITS == 3 else 16) + 32 * n, mask=run_mask, other=0,
                            eviction_policy=EVICT).to(tl.int32)
            if BITS == 3:
                second = tl.load(at, mask=run_mask, other=0, eviction_policy=EVICT).to(tl.int32) >> (4 * n)
            else:
                second = first
            third = first
        return first, second, third, block, half, mask

    @triton.jit
    def _plane(first, second, third, block, half, mask, j: tl.constexpr, BITS: tl.constexpr):
        """Plane j of _halves' runs: weights 128 half + 32 j + l. Its codes q [R, HALVES, 32] (int32, from 0)
        and the step and offset of its two sub-blocks of 16 [R, HALVES, 2]: a weight is q step - offset
        (Q3_K's and Q6_K's offset is their centre times the step: (q - centre) step as one fused
        multiply-add, rounded once)."""
        sub = (8 * (half % 2) + 2 * j)[None, :, None] + tl.arange(0, 2)[None, None, :]  # [1, HALVES, 2] 0..15
        at = block[:, :, None]
        sub_mask = mask[:, :, None]
        if BITS == 6:
            if j % 2 == 0:
                low = (first >> (4 * (j // 2))) & 15
            else:
                low = (third >> (4 * (j // 2))) & 15
            q = low | (((second >> (2 * j)) & 3) << 4)  # centre 32
            step = _q6_k_step(at, sub, sub_mask)  # [R, HALVES, 2]
            offset = 32.0 * step
        elif BITS == 3:
            q = ((first >> (2 * j)) & 3) | (((second >> j) & 1) << 2)  # centre 4: a clear hmask bit subtracts 4
            step = _q3_k_step(at, sub, sub_mask)
            offset = 4.0 * step
        else:
            q = (first >> (2 * j)) & 3
            step, offset = _q2_k_step_offset(at, sub, sub_mask)
        return q, step, offset

    @triton.jit
    def _plane_weights(first, second, third, block, half, mask, j: tl.constexpr, BITS: tl.constexpr):
        """Plane j's weights [R, HALVES, 32]."""
        q, step, offset = _plane(first, second, third, block, half, mask, j, BITS)
        R: tl.constexpr = q.shape[0]
        HALVES: tl.constexpr = q.shape[1]
        w = tl.reshape(q.to(tl.float32), (R, HALVES, 2, 16)) * step[:, :, :, None] - offset[:, :, :, None]
        return tl.reshape(w, (R, HALVES, 32))

    @triton.jit
    def _load_planes(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                     EVICT: tl.constexpr, BITS: tl.constexpr):
        """In interleaved_cols' order (SPAN 32, WAYS 4): a tile of whole halves joins the four weights of
        each byte position l."""
        R: tl.constexpr = rows.shape[0]
        if BLOCK_K >= 128:
            first, second, third, block, half, mask = _halves(w_ptr, rows, row_ok, k0, K, BLOCK_K // 128, EVICT, BITS)
            w0 = _plane_weights(first, second, third, block, half, mask, 0, BITS)
            w1 = _plane_weights(first, second, third, block, half, mask, 1, BITS)
            w2 = _plane_weights(first, second, third, block, half, mask, 2, BITS)
            w3 = _plane_weights(first, second, third, block, half, mask, 3, BITS)
            # [R, HALVES, 32, 2, 2]: place (l, a, b) holds plane 2 a + b
            w = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (R, BLOCK_K))
        elif BITS == 6:
            w = _q6_k_nibble(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT)
        elif BITS == 3:
            w = _gathered_q3_k(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT)
        else:
            w = _gathered_q2_k(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT)
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w

    @triton.jit
    def _dot_planes(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr, BITS: tl.constexpr):
        """Per plane and sub-block of 16, step * sum(q v) - offset * sum(v) (base.ExpertFormat.triton_dot)."""
        R: tl.constexpr = rows.shape[0]
        if BLOCK_K >= 128:
            HALVES: tl.constexpr = BLOCK_K // 128
            first, second, third, block, half, mask = _halves(w_ptr, rows, row_ok, k0, K, HALVES, "evict_first", BITS)
            total = tl.zeros([R], dtype=tl.float32)
            for j in tl.static_range(4):
                q, step, offset = _plane(first, second, third, block, half, mask, j, BITS)
                v = vector_runs(v_ptr + 32 * j, half, K, 128, 32)  # [HALVES, 32] plane j's columns
                qv = code_dot(tl.reshape(q, (R, HALVES, 2, 16)), tl.reshape(v, (HALVES, 2, 16))[None, :, :, :],
                              3)  # [R, HALVES, 2]
                v_sum = tl.sum(tl.reshape(v, (HALVES, 2, 16)), axis=2)  # [HALVES, 2]
                total += tl.sum(tl.sum(step * qv - offset * v_sum[None, :, :], axis=2), axis=1)
            return total
        else:
            w = _load_planes(w_ptr, rows, row_ok, k0, K, BLOCK_K, False, "evict_first", BITS)
            return in_order_dot(w, v_ptr, k0, K, BLOCK_K)

    @triton.jit
    def _load_q2_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_planes(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 2)

    @triton.jit
    def _load_q3_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_planes(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 3)

    @triton.jit
    def _load_q6_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                   EVICT: tl.constexpr):
        return _load_planes(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 6)

    @triton.jit
    def _dot_q2_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_planes(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 2)

    @triton.jit
    def _dot_q3_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_planes(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 3)

    @triton.jit
    def _dot_q6_k(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return _dot_planes(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 6)

    @triton.jit
    def _q6_k_nibble(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr):
        """Q6_K's columns k0 .. k0 + BLOCK_K (< 128: in one nibble of the ql bytes of half (k0 / 128) % 2),
        in order: [R, BLOCK_K]. ql byte 64 n + m holds weight 128 n + m in its low nibble and 128 n + 64
        + m in its high one, whose top two bits are bits 2 a and 2 a + 4 of qh[32 n + m % 32] (a = m //
        32)."""
        n = k0 // 128 % 2
        nibble = k0 // 64 % 2
        block = w_ptr + rows[:, None] * (K // 256 * 210) + k0 // 256 * 210  # [R, 1]
        m = k0 % 64 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        ql = tl.load(block + (64 * n + m)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
        qh = tl.load(block + (128 + 32 * n + m % 32)[None, :], mask=row_ok[:, None], other=0, eviction_policy=EVICT)
        q = ((ql >> (4 * nibble)) & 15) | (((qh >> (2 * (m // 32) + 4 * nibble)[None, :]) & 3) << 4)
        step = _q6_k_step(block, (8 * n + 4 * nibble + m // 16)[None, :], row_ok[:, None])  # [R, BLOCK_K]
        return (q.to(tl.int32) - 32).to(tl.float32) * step
