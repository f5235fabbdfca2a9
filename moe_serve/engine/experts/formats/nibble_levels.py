"""What GGUF's 4-bit types whose codes pick one of sixteen fixed levels share (IQ4_NL and IQ4_XS in
iq4.py, MXFP4 in ggml_mxfp4.py): weights come in runs of 32 whose codes fill 16 bytes, byte j
holding weight j's code in its low nibble and weight j + 16's in its high one, and a weight is its
run's step times the level of its code. The types differ in their blocks (one run, or eight), where
a block's codes start (its runs' 16 bytes follow one another), how a run's step is stored, and the
levels, all whole numbers in -128..127.

In the kernels a level is looked up without a table in memory: the sixteen levels are packed as
bytes into four 32-bit constants (`packed_levels`), the code's top two bits pick the word and its
low two the byte (`level_of`). A tile of whole runs reads each run's 16 bytes contiguously and
keeps each byte's two weights side by side (`level_run_cols`: interleaved_cols' order, SPAN 16,
WAYS 2); a narrower tile lies in one nibble of one run and gathers by column, in order.

A format's load and dot are load_level_runs / dot_level_runs given its geometry (BLOCK weights in
BYTES bytes a block, the codes at byte QS_AT), its STEP (a jit function (block pointers, the run
within its block, mask) -> the run's fp32 step) and its LEVEL (a jit function of the codes over
level_of with its own words).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.base import in_order_dot
    from moe_serve.engine.experts.formats.ggml_block import (
        block_runs,
        block_tile,
        interleaved_cols,
        vector_runs,
    )
except ImportError:  # no triton: only the torch path decodes
    triton = None


def packed_levels(levels: Sequence[int]) -> tuple[int, int, int, int]:
    """Sixteen levels as four signed 32-bit words, levels 4 i .. 4 i + 3 the bytes of word i, the
    first in its low byte."""
    words = [sum((levels[first + i] & 0xFF) << 8 * i for i in range(4)) for first in range(0, 16, 4)]
    return tuple(word - (1 << 32) if word >= 1 << 31 else word for word in words)


def levels_of(codes: torch.Tensor, levels: Sequence[int]) -> torch.Tensor:
    """The levels of 4-bit codes (any int dtype), as fp32."""
    return torch.tensor(levels, dtype=torch.float32, device=codes.device)[codes.long()]


if triton is not None:

    @triton.jit
    def level_of(q, W0: tl.constexpr, W4: tl.constexpr, W8: tl.constexpr, W12: tl.constexpr):
        """The level of codes q (int32, 0..15) from packed_levels' words, as fp32."""
        word = tl.where(q < 8, tl.where(q < 4, W0, W4), tl.where(q < 12, W8, W12))
        byte = (word >> ((q & 3) << 3)) & 255
        return ((byte << 24) >> 24).to(tl.float32)  # sign-extended

    @triton.jit
    def level_run_cols(k0, BLOCK_K: tl.constexpr):
        return interleaved_cols(k0, BLOCK_K, 16, 2)

    @triton.jit
    def _runs(w_ptr, rows, row_ok, k0, K: tl.constexpr, C: tl.constexpr, EVICT: tl.constexpr, BLOCK: tl.constexpr,
              BYTES: tl.constexpr, QS_AT: tl.constexpr, STEP: tl.constexpr):
        """The C runs of 32 weights from k0 (a multiple of 32): the codes of their bytes' low and high
        nibbles [R, C, 16] (weights j and 16 + j), each run's step [R, C], the runs [C]."""
        run, block, mask = block_runs(w_ptr, rows, row_ok, k0, K, C, 32, BLOCK, BYTES)  # [C], [R, C], [R, C]
        sub = run % (BLOCK // 32)  # the run within its block
        qs = block + (QS_AT + 16 * sub)[None, :]
        packed = tl.load(qs[:, :, None] + tl.arange(0, 16)[None, None, :], mask=mask[:, :, None], other=0,
                         eviction_policy=EVICT).to(tl.int32)  # [R, C, 16]
        return packed & 15, packed >> 4, STEP(block, sub[None, :], mask), run

    @triton.jit
    def _gathered(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, EVICT: tl.constexpr,
                  BLOCK: tl.constexpr, BYTES: tl.constexpr, QS_AT: tl.constexpr, STEP: tl.constexpr,
                  LEVEL: tl.constexpr):
        """Columns k0 .. k0 + BLOCK_K (< 32: one nibble of one run) in order, gathered by column."""
        G: tl.constexpr = BLOCK_K
        R: tl.constexpr = rows.shape[0]
        block, place, mask, group, first, group_mask = block_tile(w_ptr, rows, row_ok, k0, K, BLOCK_K, BLOCK, BYTES,
                                                                  G)
        # weight p: run p // 32's byte p % 16, its high nibble for p % 32 >= 16
        packed = tl.load(block + (QS_AT + ((place >> 5) << 4) + (place & 15)), mask=mask, other=0,
                         eviction_policy=EVICT).to(tl.int32)
        q = (packed >> (((place >> 4) & 1) << 2)) & 15  # [R, BLOCK_K]
        step = STEP(group, first >> 5, group_mask)  # [R, BLOCK_K / G]
        w = tl.reshape(LEVEL(q), (R, BLOCK_K // G, G)) * step[:, :, None]
        return tl.reshape(w, (R, BLOCK_K))

    @triton.jit
    def load_level_runs(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
                        EVICT: tl.constexpr, BLOCK: tl.constexpr, BYTES: tl.constexpr, QS_AT: tl.constexpr,
                        STEP: tl.constexpr, LEVEL: tl.constexpr):
        """base.ExpertFormat.triton_load of a level format, its tile in level_run_cols' order."""
        R: tl.constexpr = rows.shape[0]
        if BLOCK_K >= 32:
            low, high, step, _ = _runs(w_ptr, rows, row_ok, k0, K, BLOCK_K // 32, EVICT, BLOCK, BYTES, QS_AT, STEP)
            w = tl.reshape(tl.join(LEVEL(low) * step[:, :, None], LEVEL(high) * step[:, :, None]), (R, BLOCK_K))
        else:
            w = _gathered(w_ptr, rows, row_ok, k0, K, BLOCK_K, EVICT, BLOCK, BYTES, QS_AT, STEP, LEVEL)
        if TRANSPOSE:
            return tl.trans(w)
        else:
            return w

    @triton.jit
    def dot_level_runs(w_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr, BLOCK: tl.constexpr,
                       BYTES: tl.constexpr, QS_AT: tl.constexpr, STEP: tl.constexpr, LEVEL: tl.constexpr):
        """base.ExpertFormat.triton_dot of a level format: per run, step * sum(level[q] v) over both nibbles."""
        if BLOCK_K >= 32:
            low, high, step, run = _runs(w_ptr, rows, row_ok, k0, K, BLOCK_K // 32, "evict_first", BLOCK, BYTES,
                                         QS_AT, STEP)
            v_low, v_high = vector_runs(v_ptr, run, K, 32, 16), vector_runs(v_ptr + 16, run, K, 32, 16)  # [C, 16]
            return tl.sum(step * tl.sum(LEVEL(low) * v_low[None, :, :] + LEVEL(high) * v_high[None, :, :], axis=2),
                          axis=1)
        else:
            w = _gathered(w_ptr, rows, row_ok, k0, K, BLOCK_K, "evict_first", BLOCK, BYTES, QS_AT, STEP, LEVEL)
            return in_order_dot(w, v_ptr, k0, K, BLOCK_K)
