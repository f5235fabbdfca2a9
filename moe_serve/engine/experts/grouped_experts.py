"""The grouped expert kernel: each routed slot's weights read once per block of its tokens.

`fused_experts` runs one GEMV per (token, j-th expert), so an expert routed to n tokens is read
n times: at a 32-sequence decode step with 8 experts top-2 that is ~8 reads of each. Here, as in
vLLM's fused_moe, the T*k (token, j) pairs are grouped by slot on the device and cut into blocks
of BLOCK_M pairs of one slot each (the last block of a slot padded), so every program reads one
weight tile once for up to BLOCK_M tokens with tl.dot:

0. `_align_kernel`, one program: a stable sort of the pairs by slot, and each block's slot, first
   pair and row count. The number of blocks depends on the routing, so the kernels below launch
   for its upper bound and programs past the real count (read on the device) exit at once;
1. `_gate_up_kernel`, one program per (block, tile of I): act = activation(x·gate^T, x·up^T) (the
   layout's, activation.py: silu(gate) * up but for gpt-oss, whose biases are added to both first),
   fp32 accumulation, stored per pair in x's dtype (tl.dot's operands must match: the torch path
   rounds act the same way);
2. `_down_kernel`, one program per (block, tile of H, chunk of I): y = weight * act·down^T over
   the chunk, fp32, per pair (I is cut into chunks where the blocks and H's tiles alone are too few
   programs, as in fused_experts.py; a down bias is added, before the weight, in the first chunk only);
3. `fused_experts.sum_partials`, one program per (token, tile of H): the k pairs and the chunks
   summed in routing order (deterministic, no atomics), cast to x's dtype once.

Weight tiles are loaded through the layout's format (formats/*.py `triton_load`, a compile-time
argument): quantized slots are read as stored and decoded in registers into x's dtype before
tl.dot, as the torch path decodes them; the plain format's load is the bare tile load. A format with
tile codes (formats/base.py `triton_codes_for`: int4-zp) hands tl.dot whole-number codes instead, and
each tile's zero points and scales are applied to its fp32 products.

int4 experts with bf16 or fp16 activations and H and I multiples of 128 run grouped_int4.py's pair of
kernels in place of 1 and 2 (`kernels_for`; same launches, tiles and partial sums): the weights
are tl.dot's first operand, the codes n - 8 of one group of 128 per dot and its scale applied to
the dot's fp32 product. On an H100, a Mixtral-size layer call (H 4096, I 14336, 8 experts, top-2)
in a CUDA graph took 0.432, 0.483, 0.485 and 0.693 ms at 8, 16, 32 and 64 tokens: 1.14-1.17x faster
than these kernels' int4 tile load (~0.57 ms at 32 tokens), ~1.9x faster than bf16 experts at 8-32
tokens (0.92 ms at 32). Those figures are an experiment's (torch 2.11, Triton 3.6);
bench/quant_experts.py, whose int4 rows now take these kernels, is the bench to rerun for them.
(int4 once tried its fused-kernel trick here, 32-bit words decoded a nibble at a time, one K = 16
dot per nibble: slower than the tile load on an H200, 0.75 ms against 0.59 at 32 tokens.)

Shapes depend only on (T, k, S, H, I), so CUDA graphs capture it. H, I and k are compile-time
constants, like fused_experts.py (one compile per model shape; the align kernel, which only
graphs use, also once per power of two of T*k). The torch path in compute.py stays the reference.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from moe_serve.engine.experts.fused_experts import chunk_length, down_splits, matrix_operands, sum_partials
from moe_serve.engine.experts.layout import ExpertLayout

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.activation import gated_activation
except ImportError:  # no triton: compute.py keeps the torch path
    triton = None

DOT_MIN = 16  # tl.dot needs every tile dimension >= 16
CODE_DTYPES = (torch.bfloat16, torch.float16)  # activations a format's codes can meet on the tensor cores


@dataclass(frozen=True)
class GroupedConfig:
    """Tile sizes. block_m pairs share one read of a weight tile; the rest as in a GEMM (grouped_int4.py's
    kernels take the same: rows of a matrix per program, and elements of K per loop step)."""
    block_m: int = 16  # pairs per block (the tl.dot M); decode routes few tokens per expert
    gate_up_block_i: int = 64  # rows of I per gate/up program (a gate and an up tile each)
    gate_up_block_h: int = 128  # elements of H per loop step
    gate_up_warps: int = 4
    gate_up_stages: int = 4
    down_block_h: int = 64  # outputs of H per down program
    down_block_i: int = 128  # elements of I per loop step
    down_warps: int = 4
    down_stages: int = 4
    down_splits: int | None = None  # chunks of I per down program's tile; None: fused_experts.down_splits


@dataclass(frozen=True)
class BlockLayout:
    """Which pairs each block computes, all on the device (P = T*k pairs, pair = token * k + j).
    Entries past num_blocks are left unwritten: the kernels never read them."""
    order: torch.Tensor  # [P] int32 pair indices sorted by slot, ties in routing order
    block_slot: torch.Tensor  # [max_blocks] int32 the block's slot
    block_first: torch.Tensor  # [max_blocks] int32 where in `order` the block's pairs start
    block_rows: torch.Tensor  # [max_blocks] int32 how many pairs it has, 1..BLOCK_M
    num_blocks: torch.Tensor  # [1] int32 the real number of blocks


def max_blocks(pairs: int, num_slots: int, block_m: int) -> int:
    """Upper bound on sum_s cdiv(count_s, block_m) over the <= min(P, S) slots used: each adds at
    most block_m - 1 padding, so the bound is floor((P + used * (block_m - 1)) / block_m). It never
    exceeds the cdiv(P, block_m) + min(P, S) of vLLM's moe_align_block_size."""
    return (pairs + min(pairs, num_slots) * (block_m - 1)) // block_m


def block_layout(slot_ids: torch.Tensor, num_slots: int, block_m: int, kernel: bool | None = None,
                 routed_experts: int | None = None) -> BlockLayout:
    """Group the pairs of slot_ids [T, k] by slot in blocks of up to block_m, with no host sync.

    routed_experts: the most distinct slots slot_ids can name (the layer's experts; None: num_slots).
    The grid is sized for it: the cache's slots hold every layer's experts, so with num_slots alone
    an all-GPU 32-token step with 48 slots launched 49 blocks' programs where 8 experts give at most 11.

    kernel: the one-program Triton sort (None: while a CUDA graph is being captured). On an H100 it
    took 2-6 us in a graph where ten small torch ops (sort, scatter_add, cumsum, searchsorted) took
    21-46 us; but it compiles once per power of two of the pair count (its sort's width is a
    compile-time constant), ~1 s each, which an eager step (a prefill of any length) must not wait
    for, while a few tens of microseconds are nothing beside its forward. So graphs take the kernel,
    eager calls the torch ops; both write the same layout."""
    flat = slot_ids.reshape(-1).contiguous()  # [P]
    pairs, grid = flat.numel(), max_blocks(flat.numel(), min(num_slots, routed_experts or num_slots), block_m)
    # one allocation, each part starting 16-byte aligned (4 int32): Triton specializes pointer
    # arguments on 16-byte alignment, so parts at offsets that vary with the pair count compiled the
    # kernels again for each new mix of alignments
    parts = [pairs, grid, grid, grid, 1]
    padded = [-(-n // 4) * 4 for n in parts]
    buffer = torch.empty(sum(padded), dtype=torch.int32, device=flat.device)
    layout = BlockLayout(*(part[:n] for part, n in zip(buffer.split(padded), parts)))
    if kernel if kernel is not None else (flat.is_cuda and torch.cuda.is_current_stream_capturing()):
        pairs_pad = max(DOT_MIN, triton.next_power_of_2(pairs))  # the program sorts all pairs at once
        scratch = torch.empty(pairs_pad, dtype=torch.int64, device=flat.device)  # [P_PAD] to read sorted neighbours
        _align_kernel[(1,)](flat, scratch, layout.order, layout.block_slot, layout.block_first, layout.block_rows,
                            layout.num_blocks, pairs, P_PAD=pairs_pad, BLOCK_M=block_m)
    else:
        _fill_layout(flat.long(), num_slots, block_m, layout)
    return layout


def _fill_layout(flat: torch.Tensor, num_slots: int, block_m: int, layout: BlockLayout) -> None:
    """The align kernel's layout from torch ops (none syncs: no bincount, whose size needs the host).
    Blocks past the real count get some slot's values: the kernels never read them."""
    order = torch.sort(flat, stable=True).indices  # [P] pairs by slot, ties in routing order
    counts = torch.zeros(num_slots, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))  # [S] pairs per slot
    blocks = (counts + block_m - 1) // block_m  # [S]
    blocks_through = blocks.cumsum(0)  # [S] blocks of slots <= s
    block = torch.arange(layout.block_slot.shape[0], device=flat.device)  # [G]
    slot = torch.searchsorted(blocks_through, block, right=True).clamp_(max=num_slots - 1)  # [G]
    nth = block - (blocks_through - blocks)[slot]  # [G] the block's index among its slot's blocks
    layout.order.copy_(order)
    layout.block_slot.copy_(slot)
    layout.block_first.copy_((counts.cumsum(0) - counts)[slot] + nth * block_m)
    layout.block_rows.copy_((counts[slot] - nth * block_m).clamp(max=block_m))
    layout.num_blocks.copy_(blocks_through[-1:])


def default_config(hidden: int, intermediate: int, dtype: torch.dtype = torch.bfloat16) -> GroupedConfig:
    """The default tiles, clamped to the model's dims (but never below tl.dot's 16)."""
    return fit_config(GroupedConfig(), hidden, intermediate, dtype)


def fit_config(cfg: GroupedConfig, hidden: int, intermediate: int, dtype: torch.dtype) -> GroupedConfig:
    """Tiles no larger than the next power of two of the dim they tile: a tiny model gets one
    masked step instead of a mostly empty tile. tl.dot's minimum of 16 is kept, masks pad the rest.
    Stages are counted for 2-byte weights: fp32 tiles take twice the shared memory per stage."""
    def fit(block: int, dim: int) -> int:
        return max(DOT_MIN, min(block, triton.next_power_of_2(dim)))

    def stages(count: int) -> int:
        return max(1, count * 2 // dtype.itemsize)

    return GroupedConfig(
        block_m=max(DOT_MIN, cfg.block_m),
        gate_up_block_i=fit(cfg.gate_up_block_i, intermediate), gate_up_block_h=fit(cfg.gate_up_block_h, hidden),
        gate_up_warps=cfg.gate_up_warps, gate_up_stages=stages(cfg.gate_up_stages),
        down_block_h=fit(cfg.down_block_h, hidden), down_block_i=fit(cfg.down_block_i, intermediate),
        down_warps=cfg.down_warps, down_stages=stages(cfg.down_stages), down_splits=cfg.down_splits,
    )


def down_chunks(pairs: int, hidden: int, intermediate: int, cfg: GroupedConfig) -> int:
    """The chunks of I each down tile is cut into (cfg.down_splits, else fused_experts.down_splits),
    counted for the fewest blocks a routing of `pairs` (token, expert) pairs can give (all in full
    blocks), not for the grid's bound, which most routings leave mostly empty: a narrow H (the bench
    model's 256: 4 tiles) then still gets enough programs. Counted from a bound of 49 blocks, an
    all-GPU 32-sequence step's real ~8 blocks ran their down matrices in 128 programs, and int4's
    decode took 2.5x bf16's time there (H200, bench/step_profile.py)."""
    fewest_blocks = -(-pairs // cfg.block_m)
    h_tiles = -(-hidden // cfg.down_block_h)
    return cfg.down_splits or down_splits(fewest_blocks * h_tiles, intermediate, cfg.down_block_i)


@dataclass(frozen=True)
class GroupedKernels:
    """A gate/up and a down kernel that take the same arguments (the block layout's, the tiles', the
    activation's), but for each matrix's `operands(layout, slots, matrix, block_k, dtype)`: matrix_operands
    and what the kernel's decode needs, for loop steps of block_k and activations of dtype; and the tiles
    they run under by default."""
    gate_up: Any  # @triton.jit
    down: Any
    operands: Callable[[ExpertLayout, torch.Tensor, str, int, torch.dtype], dict]
    config: GroupedConfig
    # x [T, H] as the gate/up kernel reads it: x itself, or its columns in grouped_int4.py's order
    inputs: Callable[[torch.Tensor], torch.Tensor] = torch.Tensor.contiguous


def kernels_for(x: torch.Tensor, layout: ExpertLayout) -> GroupedKernels:
    """grouped_int4.py's kernels where they take the layout's experts for x (int4, 16-bit activations,
    dims of whole groups: grouped_int4.takes); this module's decoded tiles (or codes) otherwise."""
    from moe_serve.engine.experts import grouped_int4  # it builds on this module: imported here, not at the top

    return grouped_int4.KERNELS if grouped_int4.takes(x, layout) else TILE_KERNELS


def grouped_experts(
    x: torch.Tensor, expert_weights: torch.Tensor, slots: torch.Tensor, slot_ids: torch.Tensor,
    layout: ExpertLayout, config: GroupedConfig | None = None, routed_experts: int | None = None,
) -> torch.Tensor:
    """Same contract as compute.gathered_experts: x [T, H]; expert_weights/slot_ids [T, k];
    slots [S, numel] packed rows; routed_experts as in block_layout. Returns sum_j weight_j *
    expert_j(x) as [T, H] in x's dtype. Runs kernels_for(x, layout), under config's tiles or theirs."""
    kernels = kernels_for(x, layout)
    t, k = slot_ids.shape
    h, i = layout.hidden_size, layout.intermediate_size
    cfg = fit_config(config or kernels.config, h, i, layout.dtype)
    if t * k == 0:  # every expert of every token left to the CPU
        return torch.zeros(t, h, dtype=x.dtype, device=x.device)
    x = kernels.inputs(x)
    blocks = block_layout(slot_ids, slots.shape[0], cfg.block_m, routed_experts=routed_experts)
    grid_blocks = blocks.block_slot.shape[0]  # the most blocks any routing needs
    act = torch.empty(t * k, i, dtype=layout.dtype, device=x.device)  # [P, I]
    h_tiles = triton.cdiv(h, cfg.down_block_h)
    splits = down_chunks(t * k, h, i, cfg)
    y = torch.empty(splits, t * k, h, dtype=torch.float32, device=x.device)  # [splits, P, H] weighted, per pair
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)  # [T, H]
    pairs = {"order_ptr": blocks.order, "block_slot_ptr": blocks.block_slot, "block_first_ptr": blocks.block_first,
             "block_rows_ptr": blocks.block_rows, "num_blocks_ptr": blocks.num_blocks}
    kernels.gate_up[(grid_blocks, triton.cdiv(i, cfg.gate_up_block_i))](
        x_ptr=x, **kernels.operands(layout, slots, "gate_up", cfg.gate_up_block_h, x.dtype), **pairs, act_ptr=act,
        H=h, I=i, K=k,
        BLOCK_M=cfg.block_m, BLOCK_I=cfg.gate_up_block_i, BLOCK_H=cfg.gate_up_block_h,
        **layout.activation.kernel_args, num_warps=cfg.gate_up_warps, num_stages=cfg.gate_up_stages,
    )
    kernels.down[(grid_blocks, h_tiles, splits)](
        act_ptr=act, **kernels.operands(layout, slots, "down", cfg.down_block_i, act.dtype),
        weights_ptr=expert_weights.reshape(-1).contiguous(),
        **pairs, y_ptr=y, pair_count=t * k, i_chunk=chunk_length(i, cfg.down_block_i, splits), H=h, I=i,
        BLOCK_M=cfg.block_m, BLOCK_H=cfg.down_block_h, BLOCK_I=cfg.down_block_i, num_warps=cfg.down_warps,
        num_stages=cfg.down_stages,
    )
    sum_partials(y, out, k)
    return out


def _with_codes(layout: ExpertLayout, slots: torch.Tensor, matrix: str, block_k: int, dtype: torch.dtype) -> dict:
    """matrix_operands plus the format's tile codes where it has them for these tiles and activations
    (formats/base.py triton_codes_for; a constexpr function argument cannot be None)."""
    operands = matrix_operands(layout, slots, matrix)
    fmt = layout.format_of(matrix)
    codes = fmt.triton_codes_for(layout.shape(matrix)[1], block_k) if dtype in CODE_DTYPES else None
    return {**operands, "CODES": operands["LOAD"] if codes is None else codes, "USE_CODES": codes is not None}


if triton is not None:

    @triton.jit
    def _max(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _min(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _align_kernel(ids_ptr, scratch_ptr, order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr,
                      num_blocks_ptr, P, P_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """One program: sort the pairs by slot, then cut each slot's run into blocks of BLOCK_M."""
        p = tl.arange(0, P_PAD)
        real = p < P
        slot = tl.load(ids_ptr + p, mask=real, other=2**31 - 1).to(tl.int64)  # padding sorts last
        key = tl.sort(slot * P_PAD + p)  # unique keys: a stable sort by slot
        sorted_slot = key // P_PAD
        tl.store(scratch_ptr + p, sorted_slot)
        tl.debug_barrier()  # the stores above are visible to the whole program: read the neighbours
        prev = tl.load(scratch_ptr + p - 1, mask=p > 0, other=-1)
        following = tl.load(scratch_ptr + p + 1, mask=p < P_PAD - 1, other=-1)
        run_first = tl.associative_scan(tl.where(sorted_slot != prev, p, 0), 0, _max)  # [P_PAD] start of p's run
        run_last = tl.associative_scan(tl.where(sorted_slot != following, p, P_PAD), 0, _min, reverse=True)
        starts_block = real & ((p - run_first) % BLOCK_M == 0)
        block = tl.cumsum(starts_block.to(tl.int32), 0) - 1  # [P_PAD] the block of p
        tl.store(order_ptr + p, (key % P_PAD).to(tl.int32), mask=real)
        tl.store(block_slot_ptr + block, sorted_slot.to(tl.int32), mask=starts_block)
        tl.store(block_first_ptr + block, p, mask=starts_block)
        tl.store(block_rows_ptr + block, tl.minimum(run_last - p + 1, BLOCK_M), mask=starts_block)
        tl.store(num_blocks_ptr, tl.sum(starts_block.to(tl.int32), 0))

    @triton.jit
    def block_pairs(block, order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr, w_ptr, s_ptr, row_stride,
                    scale_stride, DATA: tl.constexpr, SCALES: tl.constexpr, BLOCK_M: tl.constexpr):
        """The block's slot, its BLOCK_M pair indices (token * K + j) with a mask for the padding, and where
        the slot's matrix (DATA elements into its row) and the matrix's scales start."""
        first = tl.load(block_first_ptr + block)
        m = tl.arange(0, BLOCK_M)
        pair_ok = m < tl.load(block_rows_ptr + block)
        pairs = tl.load(order_ptr + first + m, mask=pair_ok, other=0)
        slot = tl.load(block_slot_ptr + block).to(tl.int64)  # int64: slot * row_stride passes 2**31 on big caches
        return slot, pairs, pair_ok, w_ptr + slot * row_stride + DATA, s_ptr + slot * scale_stride + SCALES

    @triton.jit
    def store_act(acc_gate, acc_up, b_ptr, slot, bias_stride, act_ptr, pairs, pair_ok, rows, row_ok, act_cols,
                  I: tl.constexpr, BIAS: tl.constexpr, BIASES: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr,
                  ALPHA: tl.constexpr, LIMIT: tl.constexpr):
        """act [P, I] (its dtype) = activation(gate, up) of the fp32 tiles acc_gate and acc_up, gate_up's bias
        added first. pairs and rows index the tiles' two dims as 2-D tensors that broadcast ([M, 1] and [1, N],
        or [1, M] and [N, 1] for grouped_int4.py's turned-around tiles), with their masks; act_cols (shaped as
        rows) is the column of act each row's activation goes to: rows itself, or grouped_int4.py's order."""
        if BIASES:  # gate_up's bias [2I], gate's first
            bias_ptr = b_ptr + slot * bias_stride + BIAS
            acc_gate += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            acc_up += tl.load(bias_ptr + I + rows, mask=row_ok, other=0.0).to(tl.float32)
        act = gated_activation(acc_gate, acc_up, CLAMPED_SWIGLU, ALPHA, LIMIT)
        tl.store(act_ptr + pairs * I + act_cols, act.to(act_ptr.dtype.element_ty), mask=pair_ok & row_ok)

    @triton.jit
    def store_partial(acc, b_ptr, slot, bias_stride, weights_ptr, y_ptr, pair_count, pairs, pair_ok, outs, out_ok,
                      H: tl.constexpr, BIAS: tl.constexpr, BIASES: tl.constexpr):
        """This chunk of I's part of y [splits, P, H] (fp32): the routing weight times the fp32 tile acc, plus
        down's bias in the first chunk only. pairs and outs index the tile's dims as in store_act."""
        if BIASES:  # noqa: SIM102 - a compile-time test: without biases, b_ptr (None) must not be compiled in
            if tl.program_id(2) == 0:  # down's bias [H], part of the expert's output: added by one chunk of I
                acc += tl.load(b_ptr + slot * bias_stride + BIAS + outs, mask=out_ok, other=0.0).to(tl.float32)
        weight = tl.load(weights_ptr + pairs, mask=pair_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + (tl.program_id(2) * pair_count + pairs) * H + outs, acc * weight, mask=pair_ok & out_ok)

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr,
                        num_blocks_ptr, act_ptr, row_stride, scale_stride, bias_stride, H: tl.constexpr,
                        I: tl.constexpr, K: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr,
                        BIAS: tl.constexpr, BIASES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr,
                        BLOCK_H: tl.constexpr, LOAD: tl.constexpr, COLS: tl.constexpr, CODES: tl.constexpr,
                        USE_CODES: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, ALPHA: tl.constexpr,
                        LIMIT: tl.constexpr):
        block = tl.program_id(0)
        if block >= tl.load(num_blocks_ptr):  # the grid is launched for the most blocks any routing needs
            return
        slot, pairs, pair_ok, gate_ptr, scale_ptr = block_pairs(  # gate_up [2I, H], gate rows first, in the format
            block, order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr, w_ptr, s_ptr, row_stride, scale_stride,
            DATA, SCALES, BLOCK_M)
        token = pairs // K
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I] rows of I
        row_ok = rows < I
        acc_gate = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            col = COLS(h0, BLOCK_H)  # [BLOCK_H] in the order of the loaded tiles' columns
            col_ok = col < H
            xt = tl.load(x_ptr + token[:, None] * H + col[None, :], mask=pair_ok[:, None] & col_ok[None, :],
                         other=0.0)  # [BLOCK_M, BLOCK_H]
            if USE_CODES:  # [BLOCK_H, BLOCK_I] codes: x·w = (x·codes - zero sum(x)) * scale, per row of the tile
                x_sum = tl.sum(xt.to(tl.float32), axis=1)[:, None]  # [BLOCK_M, 1]
                gate, gate_scale, gate_zero = CODES(gate_ptr, scale_ptr, rows, row_ok, h0, H, BLOCK_H, xt.dtype)
                up, up_scale, up_zero = CODES(gate_ptr, scale_ptr, rows + I, row_ok, h0, H, BLOCK_H, xt.dtype)
                acc_gate += (tl.dot(xt, gate) - gate_zero[None, :] * x_sum) * gate_scale[None, :]
                acc_up += (tl.dot(xt, up) - up_zero[None, :] * x_sum) * up_scale[None, :]
            else:
                # [BLOCK_H, BLOCK_I]: transposed views of the gate and up rows, decoded into x's dtype
                gate = LOAD(gate_ptr, scale_ptr, rows, row_ok, h0, H, BLOCK_H, True, "").to(xt.dtype)
                up = LOAD(gate_ptr, scale_ptr, rows + I, row_ok, h0, H, BLOCK_H, True, "").to(xt.dtype)
                acc_gate = tl.dot(xt, gate, acc_gate, input_precision="ieee")  # "ieee": fp32 stays fp32, not tf32
                acc_up = tl.dot(xt, up, acc_up, input_precision="ieee")
        store_act(acc_gate, acc_up, b_ptr, slot, bias_stride, act_ptr, pairs[:, None], pair_ok[:, None], rows[None, :],
                  row_ok[None, :], rows[None, :], I, BIAS, BIASES, CLAMPED_SWIGLU, ALPHA, LIMIT)

    @triton.jit
    def _down_kernel(act_ptr, w_ptr, s_ptr, b_ptr, weights_ptr, order_ptr, block_slot_ptr, block_first_ptr,
                     block_rows_ptr, num_blocks_ptr, y_ptr, pair_count, i_chunk, row_stride, scale_stride,
                     bias_stride, H: tl.constexpr, I: tl.constexpr, DATA: tl.constexpr, SCALES: tl.constexpr,
                     BIAS: tl.constexpr, BIASES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_I: tl.constexpr, LOAD: tl.constexpr, COLS: tl.constexpr, CODES: tl.constexpr,
                     USE_CODES: tl.constexpr):
        block = tl.program_id(0)
        if block >= tl.load(num_blocks_ptr):
            return
        slot, pairs, pair_ok, down_ptr, scale_ptr = block_pairs(  # down [H, I], in the format
            block, order_ptr, block_slot_ptr, block_first_ptr, block_rows_ptr, w_ptr, s_ptr, row_stride, scale_stride,
            DATA, SCALES, BLOCK_M)
        outs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] outputs of H
        out_ok = outs < H
        acc = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
        first = tl.program_id(2) * i_chunk  # this program's chunk of I: whole tiles
        for step in range(0, i_chunk, BLOCK_I):
            i0 = first + step
            col = COLS(i0, BLOCK_I)  # [BLOCK_I] in the order of the loaded tile's columns
            col_ok = col < I
            a = tl.load(act_ptr + pairs[:, None] * I + col[None, :], mask=pair_ok[:, None] & col_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_I]
            if USE_CODES:  # as in the gate/up kernel
                codes, scale, zero = CODES(down_ptr, scale_ptr, outs, out_ok, i0, I, BLOCK_I, a.dtype)  # [BLOCK_I, BLOCK_H]
                acc += (tl.dot(a, codes) - zero[None, :] * tl.sum(a.to(tl.float32), axis=1)[:, None]) * scale[None, :]
            else:
                # [BLOCK_I, BLOCK_H]: a transposed view of the down rows, decoded into act's dtype
                w = LOAD(down_ptr, scale_ptr, outs, out_ok, i0, I, BLOCK_I, True, "").to(a.dtype)
                acc = tl.dot(a, w, acc, input_precision="ieee")
        store_partial(acc, b_ptr, slot, bias_stride, weights_ptr, y_ptr, pair_count, pairs[:, None], pair_ok[:, None],
                      outs[None, :], out_ok[None, :], H, BIAS, BIASES)

    TILE_KERNELS = GroupedKernels(_gate_up_kernel, _down_kernel, _with_codes, GroupedConfig())
