"""What the GGML block formats (llama.cpp's quantization types, as GGUF files store them) share:
a row of K weights is K / BLOCK self-contained blocks of BYTES bytes each, every scale inside its
block, so an encoded matrix is uint8 [N, K / BLOCK * BYTES] with no scales section, and the rows
of a GGUF tensor are our rows byte for byte (the GGUF loader copies them as they are).

A format here names its GGML type (`ggml_type`, as the gguf package spells it), codes one block at
a time in torch, and has K of whole blocks (col_multiple); the kernels' loads live in each
format's file, over `block_tile`'s addressing. The bytes are little-endian, as GGUF files and
every GPU we run on are.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import torch

from moe_serve.engine.experts.formats.base import ExpertFormat

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: only the torch path decodes
    triton = None


class GgmlBlockFormat(ExpertFormat):
    ggml_type: ClassVar[str]  # gguf.GGMLQuantizationType's name: "Q4_K"
    block: ClassVar[int]  # weights per block
    block_bytes: ClassVar[int]
    data_dtype: torch.dtype = torch.uint8

    def data_cols(self, k: int) -> int:
        return k // self.block * self.block_bytes

    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, None]:
        self.check_shape(w.shape[-2], w.shape[-1])
        blocks = self.encode_blocks(w.float().unflatten(-1, (-1, self.block)))  # [..., N, K / BLOCK, BYTES]
        return blocks.flatten(-2), None

    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        return self.decode_blocks(data.unflatten(-1, (k // self.block, self.block_bytes))).flatten(-2).to(dtype)

    @abstractmethod
    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        """w [..., BLOCK] fp32 -> [..., BYTES] uint8."""

    @abstractmethod
    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        """[..., BYTES] uint8 -> [..., BLOCK] fp32, the reference dequantization (llama.cpp's, bit for bit)."""

    def describe(self) -> str:
        return f"{self.name} (GGUF {self.ggml_type}, {self.block_bytes * 8 / self.block:g} bits per weight)"


def fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 stored at bytes offset, offset + 1 of each block [..., BYTES], as fp32 [...]."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16)[..., 0].float()


def fp16_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 [...] -> its fp16 as two bytes [..., 2], to store in a block."""
    return x.to(torch.float16).unsqueeze(-1).view(torch.uint8)


def nibbles(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """Two tensors of 4-bit codes (any int dtype) -> one byte each, `low` in the low nibble."""
    return (low.to(torch.uint8) & 0xF) | ((high.to(torch.uint8) & 0xF) << 4)


def split_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [..., 32] of one 32-weight block -> 16 bytes, byte j holding code j in its low
    nibble and code j + 16 in its high one (Q4_0 to Q5_1's and the IQ4 types' order)."""
    return nibbles(codes[..., :16], codes[..., 16:])


def unsplit_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes [..., 16] -> the 4-bit codes [..., 32] (int32) split_nibbles packed."""
    b = qs.to(torch.int32)
    return torch.cat((b & 15, b >> 4), dim=-1)


if triton is not None:
    FP16 = tl.constexpr(tl.pointer_type(tl.float16))  # blocks' fp16 fields: 2-byte aligned in every format

    @triton.jit
    def block_tile(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK: tl.constexpr,
                   BYTES: tl.constexpr, G: tl.constexpr):
        """Where a kernel tile of rows [R] x columns k0 + arange(BLOCK_K) lies in the blocks at w_ptr
        (rows of K / BLOCK blocks of BYTES): for each weight, the byte pointer of its block
        [R, BLOCK_K], its place in the block [BLOCK_K] and the load mask; then the same for the
        tile's groups of G columns that share one scale ([R, BLOCK_K / G], [BLOCK_K / G] and mask).
        G divides BLOCK_K and the block size, and k0 is a multiple of BLOCK_K: a group never
        straddles two scales, whether a tile holds many blocks or lies inside one."""
        row_start = w_ptr + rows[:, None] * (K // BLOCK * BYTES)  # [R, 1]
        cols = k0 + tl.arange(0, BLOCK_K)
        first = k0 + tl.arange(0, BLOCK_K // G) * G  # each group's first column
        if K % BLOCK_K == 0:  # no tile runs past the row: only rows are masked
            mask = row_ok[:, None]
            group_mask = mask
        else:
            mask = row_ok[:, None] & (cols < K)[None, :]
            group_mask = row_ok[:, None] & (first < K)[None, :]
        return (row_start + cols // BLOCK * BYTES, cols % BLOCK, mask,
                row_start + first // BLOCK * BYTES, first % BLOCK, group_mask)

    @triton.jit
    def block_runs(w_ptr, rows, row_ok, k0, K: tl.constexpr, C: tl.constexpr, RUN: tl.constexpr,
                   BLOCK: tl.constexpr, BYTES: tl.constexpr):
        """The C runs of RUN columns from k0 (a multiple of RUN, which divides the block size BLOCK) of
        rows [R] of blocks of BYTES at w_ptr: the runs [C], the pointer to each run's block [R, C] and
        the mask [R, C] (runs past K masked): where the run-reading loads find their bytes."""
        run = k0 // RUN + tl.arange(0, C)  # [C]
        block = w_ptr + rows[:, None] * (K // BLOCK * BYTES) + (run // (BLOCK // RUN) * BYTES)[None, :]
        mask = row_ok[:, None] & (run < K // RUN)[None, :]
        return run, block, mask

    @triton.jit
    def vector_runs(v_ptr, run, K: tl.constexpr, RUN: tl.constexpr, WIDTH: tl.constexpr):
        """[C, WIDTH] fp32: the vector's elements RUN run .. RUN run + WIDTH - 1 for the runs [C] (0 past
        K); v_ptr advanced by a part's offset gives that part of each run (a nibble's, a plane's)."""
        return tl.load(v_ptr + (RUN * run)[:, None] + tl.arange(0, WIDTH)[None, :], mask=(run < K // RUN)[:, None],
                       other=0.0).to(tl.float32)

    @triton.jit
    def interleaved_cols(k0, BLOCK_K: tl.constexpr, SPAN: tl.constexpr, WAYS: tl.constexpr):
        """The tile order of a format whose byte m of a run holds columns m, SPAN + m, ..., (WAYS - 1)
        SPAN + m (nibbles: WAYS 2, Q4_K's SPAN 32, Q6_K's 64, Q4_0's 16; Q2_K's 2-bit planes: WAYS 4,
        SPAN 32): a tile of whole runs of WAYS SPAN columns holds each byte's columns side by side, as
        its load joins them (so a run's bytes are read once, contiguously, and never shuffled back
        into order); a narrower tile lies in one part of its bytes and is in order."""
        p = tl.arange(0, BLOCK_K)
        RUN: tl.constexpr = WAYS * SPAN
        if BLOCK_K >= RUN:  # place p: run p // RUN, part p % WAYS, byte (p % RUN) // WAYS
            return k0 + (p // RUN) * RUN + (p % WAYS) * SPAN + (p % RUN) // WAYS
        else:
            return k0 + p
