"""The grouped kernels for int4 experts: the weights as tl.dot's first operand, in the order they load.

grouped_experts.py's kernels put a block's pairs first, acc[BLOCK_M, BLOCK_N] += x · w^T, with each
int4 tile decoded into x's dtype, its scales multiplied in, before the dot. These two turn the tile
around, acc[BLOCK_N, BLOCK_M] += w · x^T ("swap-AB"): BLOCK_N rows of the weight matrix (I's for
gate/up, H's for down) are the mma's M, of which Hopper's wgmma wants 64 and which it can take from
registers, where the decode leaves the weights; a block's 16 pairs are its N. One dot per group of
int4's 128 weights along K, and the group's fp16 scale multiplies the dot's fp32 product once per
row, so no weight is rounded to x's dtype.

The dot runs over a group's columns in "dot order", not in order: a sum over K is the same in any
order shared by both operands, and this one is the order in which each thread already holds the
weights. A thread of an mma's A operand holds, per 16 columns, the register pairs of places
(2t, 2t + 1) and (2t + 8, 2t + 9), t its lane among 4; it loads its 16 bytes of a group's row as
four 32-bit words, and ((word >> 4i) & 0x000F000F) | 0x43004300 puts the nibbles i and i + 4 of a
word, read as bf16, into the two halves of one such register: 128 + n each, less 136 (fp16: 1024 + n
and 0x6400, less 1032) the exact codes n - 8, with no int-to-float conversion. So place
32m + 8i + 2t + p of a group holds column 32t + 8m + 4p + i (m, i, t < 4, p < 2: word 4t + m,
nibble i + 4p), and the weights' reshapes into that order only relabel registers. The activations
come in the same order: x permuted once per call (dot_order, GroupedKernels.inputs), and act, which
the gate/up kernel writes for the down kernel, stored so (_dot_place). Before, the kernels joined
each byte's two nibbles into column order, which left each thread's bytes 4 apart: 64 one-byte
loads from shared memory a step. Counted in the sm_90 SASS of the K loop at the Mixtral shape
(`python bench/kernel_sass.py --kernel grouped-int4`, bench/results/quant/kernel_sass-grouped-int4-sm90*.json),
gate/up went from 718 to 400 instructions a step (5.6 to 3.1 a weight; down's, counted likewise,
from 788 to 475). In one H100 call (bench/quant_experts.py, the kernels of column order from a copy
of their tree) the Mixtral-size layer call took 0.413 -> 0.360, 0.478 -> 0.426 and 0.688 -> 0.475
ms at 8, 32 and 64 tokens: 2.15x, 2.15x and 2.03x bf16's (1.88x, 1.91x and 1.41x before); with
INT4_CONFIG's tiles of the sweep that followed, 2.51x, 2.54x and 2.09x (a later call, bf16 beside it).
Where a tile divides its dim (K, a gate/up tile's rows of I, a down tile's outputs of H: the Mixtral
shape's at the default tiles) the loads drop that mask (EVEN, _inside), which took the gate/up loop
from 772 to 698 instructions a step of 256 (down's from 617 to 569, and to 392 with its chunk of I a
compile-time constant: _down_kernel). Timed together in one H100 call against a copy of the tree
before them: 0.342 -> 0.297, 0.366 -> 0.319 and 0.444 -> 0.369 ms at 8, 32 and 64 tokens, so 2.97x,
2.95x and 2.70x bf16's (bench/results/quant/quant_experts-h100-int4-{before-even,even-chunk-2}.json).

The kernels of column order ran that call 1.14-1.17x faster than the decoded tiles at 8-64 tokens
on an H100 (grouped_experts.py's docstring has the numbers). Against the same
decoded tiles, other ways ran about 0.90x (two dots of K = 64, the nibbles left out of order,
against x's even and odd elements), 1.06x (codes made by inline PTX), 1.0x (codes 128 + n, 136
sum(x) taken off each product) and 0.72x (an fp32 decode). In dot order, with the masks and the
constant chunk, two gate/up decodes that leave out the subtraction of 136 were no faster than this
one in the same H100 call though their loops are shorter (quant_experts-h100-int4-{subnormal,offset}-codes*.json):
the codes as subnormal floats (n x 2^-133 in bf16, x prescaled by 2^100, the zero point from x's group
sums; 576 instructions a step) 0.302 / 0.324 / 0.370 ms at 8 / 32 / 64 tokens, and codes 128 + n
with 136 times the group sums taken off each group's dot (624) 0.307 / 0.330 / 0.396, against this
kernel's 0.297 / 0.319 / 0.369: the loop is no longer what bounds it.

Taken for bf16 and fp16 activations (the 16-bit dot's operands; fp32 keeps the decoded tiles) and H
and I multiples of 128, int4's group: a row is then whole groups of 64 bytes, so rows and loop steps
stay aligned for wide loads and no group is cut by K's end. Those are the dims measured (Mixtral's)
and tested; others (small test models, gpt-oss's 2880) keep the decoded tiles.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_serve.engine.experts.formats.int4 import GROUP_SIZE, Int4
from moe_serve.engine.experts.fused_experts import matrix_operands
from moe_serve.engine.experts.grouped_experts import (
    CODE_DTYPES,
    GroupedConfig,
    GroupedKernels,
    block_pairs,
    store_act,
    store_partial,
)
from moe_serve.engine.experts.layout import MATRICES, ExpertLayout

# the best tiles of each kernel at 32 tokens (Mixtral size, H100), as (BLOCK_N, BLOCK_K, warps, stages).
# In dot order (bench/quant_experts.py --sweep, bench/results/quant/quant_sweep-int4-h100-dot-order.json,
# the whole layer call timed): gate/up's K step of two groups, (64, 256, 4, 3), 0.363 ms against 0.427
# under column order's best, (64, 128, 4, 4), and 0.376-0.672 under the other four; down's tiles held,
# 0.359 against 0.366-0.498. (Column order's sweep had also tried (128, 128, 4, 3), (128, 256, 4, 3)
# and (128, 128, 8, 4): none was the best of either kernel.)
INT4_CONFIG = GroupedConfig(block_m=16, gate_up_block_i=64, gate_up_block_h=256, gate_up_warps=4, gate_up_stages=3,
                            down_block_h=64, down_block_i=256, down_warps=4, down_stages=3)


def takes(x: torch.Tensor, layout: ExpertLayout) -> bool:
    """Whether these kernels run the layout's experts for x: both matrices int4 (int4-zp's zero points go
    through grouped_experts' codes), x 16-bit and the layout's dtype, H and I whole groups (the module docstring says why)."""
    return (all(isinstance(layout.format_of(matrix), Int4) for matrix in MATRICES)
            and x.dtype in CODE_DTYPES and x.dtype == layout.dtype
            and layout.hidden_size % GROUP_SIZE == 0 and layout.intermediate_size % GROUP_SIZE == 0)


def _operands(layout: ExpertLayout, slots: torch.Tensor, matrix: str, block_k: int, dtype: torch.dtype) -> dict:
    """GroupedKernels.operands: matrix_operands less the format's tile load (these kernels decode int4
    themselves), and int4's group. A loop step (block_k) must hold whole groups. The activations' dtype
    changes nothing: takes() lets only 16-bit ones in."""
    if block_k % GROUP_SIZE:
        raise ValueError(f"int4's grouped kernels step through whole groups of {GROUP_SIZE}; "
                         f"{matrix}'s step of {block_k} is not")
    operands = matrix_operands(layout, slots, matrix)
    del operands["LOAD"], operands["COLS"]
    return {**operands, "GROUP": GROUP_SIZE}


def dot_order(x: torch.Tensor) -> torch.Tensor:
    """x [T, H] with each group's 128 columns in dot order (GroupedKernels.inputs): place
    32m + 8i + 2t + p holds column 32t + 8m + 4p + i (m, i, t < 4; p < 2)."""
    t, h = x.shape
    return x.reshape(t, h // GROUP_SIZE, 4, 4, 2, 4).permute(0, 1, 3, 5, 2, 4).reshape(t, h)  # a contiguous copy


@triton.jit
def _dot_place(col):
    """The dot-order place of each column of act (within its group of 128, as dot_order's)."""
    return col - col % 128 + 32 * ((col // 8) % 4) + 8 * (col % 4) + 2 * ((col % 128) // 32) + (col // 4) % 2


@triton.jit
def _pair_codes(words, SHIFT: tl.constexpr, DTYPE: tl.constexpr):
    """Nibbles SHIFT / 4 and SHIFT / 4 + 4 of int32 words [R, W] as codes n - 8 in DTYPE (bf16 or fp16),
    [R, W, 2], exactly: both masked into the halves of one word at once, OR'd into the bits of 128 (bf16;
    fp16's 1024), each half read as DTYPE, then 136 (1032) taken off in DTYPE."""
    BITS: tl.constexpr = 0x43004300 if DTYPE == tl.bfloat16 else 0x64006400
    bits = ((words >> SHIFT) & 0x000F000F) | BITS
    zero = tl.full((1, 1, 1), 136.0 if DTYPE == tl.bfloat16 else 1032.0, DTYPE)  # the subtraction stays in DTYPE
    low = (bits & 0xFFFF).to(tl.int16).to(DTYPE, bitcast=True)
    high = (bits >> 16).to(tl.int16).to(DTYPE, bitcast=True)
    return tl.join(low, high) - zero


@triton.jit
def _inside(index, N: tl.constexpr, BLOCK: tl.constexpr):
    """index < N, for a tile's indices [BLOCK]: true throughout, as a constant, where BLOCK divides N, so
    that no load is masked by it."""
    if N % BLOCK == 0:
        return tl.full(index.shape, 1, tl.int1)
    return index < N


@triton.jit
def _group_columns(v_ptr, vrows, v_ok, kg, K: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr):
    """The activations of rows vrows [M] (K apart) over the group of places kg .. kg + GROUP - 1,
    transposed: [GROUP, M], 0 for a group past K (a loop step that does not divide K; EVEN: none is)."""
    cols = kg + tl.arange(0, GROUP)
    inside = v_ok[None, :] if EVEN else (cols < K)[:, None] & v_ok[None, :]
    return tl.load(v_ptr + vrows[None, :] * K + cols[:, None], mask=inside, other=0.0)


@triton.jit
def _group_dot(w_ptr, s_ptr, rows, row_ok, kg, K: tl.constexpr, GROUP: tl.constexpr, EVEN: tl.constexpr, vt, acc):
    """acc [R, M] (fp32) plus rows [R] of the int4 matrix at w_ptr (its fp16 scales at s_ptr) times vt
    [GROUP, M], the activations of the group at column kg in dot order: one dot, then the group's scale."""
    R: tl.constexpr = rows.shape[0]
    word = kg // 8 + tl.arange(0, GROUP // 8)  # [16]: word 4t + m holds columns 32t + 8m .. 32t + 8m + 7
    # a masked word's nibbles are 8s, codes 0 (0x88888888 as an int32); EVEN: no group is past K
    inside = row_ok[:, None] if EVEN else row_ok[:, None] & (word < K // 8)[None, :]
    words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 8) + word[None, :],
                    mask=inside, other=-0x77777778)  # [R, 16]
    # a group past K reads the row's last scale: vt is 0 there
    group = kg // GROUP if EVEN else tl.minimum(kg // GROUP, K // GROUP - 1)
    scale = tl.load(s_ptr + rows * (K // GROUP) + group, mask=row_ok, other=0.0)
    codes = tl.join(tl.join(_pair_codes(words, 0, vt.dtype), _pair_codes(words, 4, vt.dtype)),
                    tl.join(_pair_codes(words, 8, vt.dtype), _pair_codes(words, 12, vt.dtype)))  # [R, 16, 2, 2, 2]
    # [R, t, m, p, i % 2, i // 2] -> [R, m, i // 2, i % 2, t, p]: dot order, the registers' own
    codes = tl.reshape(tl.permute(tl.reshape(codes, (R, 4, 4, 2, 2, 2)), (0, 2, 5, 4, 1, 3)), (R, GROUP))
    return acc + tl.dot(codes, vt) * scale.to(tl.float32)[:, None]


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr,
                    num_blocks_ptr, act_ptr, row_stride, scale_stride, bias_stride, H: tl.constexpr, I: tl.constexpr,
                    K: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr, BIAS: tl.constexpr,
                    BIASES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_H: tl.constexpr,
                    GROUP: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    block = tl.program_id(0)
    if block >= tl.load(num_blocks_ptr):  # the grid is launched for the most blocks any routing needs
        return
    slot, pairs, pair_ok, gate_ptr, scale_ptr = block_pairs(  # gate_up [2I, H] int4, gate rows first
        block, order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr, w_ptr, s_ptr, row_stride, scale_stride,
        DATA, SCALES, BLOCK_M)
    rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] rows of I: the dot's M
    row_ok = _inside(rows, I, BLOCK_I)
    token = pairs // K
    acc_gate = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
    EVEN: tl.constexpr = H % BLOCK_H == 0  # no loop step runs past H: its loads need no mask along K
    for h0 in range(0, H, BLOCK_H):
        for g in tl.static_range(BLOCK_H // GROUP):  # the loop step's groups, one dot each
            kg = h0 + g * GROUP
            xt = _group_columns(x_ptr, token, pair_ok, kg, H, GROUP, EVEN)  # [GROUP, BLOCK_M]
            acc_gate = _group_dot(gate_ptr, scale_ptr, rows, row_ok, kg, H, GROUP, EVEN, xt, acc_gate)
            acc_up = _group_dot(gate_ptr, scale_ptr, rows + I, row_ok, kg, H, GROUP, EVEN, xt, acc_up)
    # act in dot order, as the down kernel reads it
    store_act(acc_gate, acc_up, b_ptr, slot, bias_stride, act_ptr, pairs[None, :], pair_ok[None, :], rows[:, None],
              row_ok[:, None], _dot_place(rows)[:, None], I, BIAS, BIASES, CLAMPED_SWIGLU, ALPHA, LIMIT)


@triton.jit
def _down_kernel(act_ptr, w_ptr, s_ptr, b_ptr, weights_ptr, order_ptr, block_slot_ptr, block_first_ptr,
                 block_rows_ptr, num_blocks_ptr, y_ptr, pair_count, i_chunk: tl.constexpr, row_stride, scale_stride,
                 bias_stride, H: tl.constexpr, I: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr,
                 BIAS: tl.constexpr, BIASES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_I: tl.constexpr, GROUP: tl.constexpr):
    # i_chunk is a compile-time constant (one build per chunk count, a few per model): with the loop's
    # trip count known, Triton pipelines act's loads as async copies into shared memory (LDGSTS) where a
    # runtime count left them loads through registers and stores (sm_90 SASS of the loop at the Mixtral
    # shape: 569 -> 392 instructions a step)
    block = tl.program_id(0)
    if block >= tl.load(num_blocks_ptr):
        return
    slot, pairs, pair_ok, down_ptr, scale_ptr = block_pairs(  # down [H, I] int4
        block, order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr, w_ptr, s_ptr, row_stride, scale_stride,
        DATA, SCALES, BLOCK_M)
    outs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] outputs of H: the dot's M
    out_ok = _inside(outs, H, BLOCK_H)
    acc = tl.zeros([BLOCK_H, BLOCK_M], dtype=tl.float32)
    first = tl.program_id(2) * i_chunk  # this program's chunk of I: whole tiles
    EVEN: tl.constexpr = I % BLOCK_I == 0  # the chunks' tiles then end at I (fused_experts.chunk_length)
    for step in range(0, i_chunk, BLOCK_I):
        for g in tl.static_range(BLOCK_I // GROUP):
            kg = first + step + g * GROUP
            at = _group_columns(act_ptr, pairs, pair_ok, kg, I, GROUP, EVEN)  # [GROUP, BLOCK_M]
            acc = _group_dot(down_ptr, scale_ptr, outs, out_ok, kg, I, GROUP, EVEN, at, acc)
    store_partial(acc, b_ptr, slot, bias_stride, weights_ptr, y_ptr, pair_count, pairs[None, :], pair_ok[None, :],
                  outs[:, None], out_ok[:, None], H, BIAS, BIASES)


KERNELS = GroupedKernels(_gate_up_kernel, _down_kernel, _operands, INT4_CONFIG, dot_order)
