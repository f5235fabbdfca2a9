"""The fused expert kernel: a few tokens' routed SwiGLU experts, read in place from their slots.

The torch path of `gathered_experts` copies every routed expert's packed row out of the slot
buffer before two batched matmuls: at decode that copy moves as many bytes as the matmuls read.
These two Triton kernels are memory-bound GEMVs that read the selected slots where they lie:

1. `_gate_up_kernel`, one program per (token, j-th expert, block of I rows):
   act = activation(gate_rows · x, up_rows · x), fp32, into act [T*k, I] (the layout's
   activation.py activation, silu(gate) * up but for gpt-oss; its biases added to both dots first);
2. `_down_kernel`, one program per (token, block of H outputs, chunk of I), looping over the
   token's k experts: y = sum_j weight_j * down_j[h_block, i_chunk] · act_j[i_chunk], so the
   routing weights and the sum over k are folded in, in a fixed order (deterministic: no atomics);
   an expert's down bias is added to its sum by the programs of the first chunk only.
   A model of few outputs and a wide I (the Mixtral-size bench model: H 256, I 229,120) gives too
   few programs to fill the GPU with whole rows, so I is cut into chunks (`down_splits`), each
   program's sum goes to a partial [splits, T, H], and `sum_partials` adds them in a fixed order.

Weights are loaded through their matrix's format (formats/*.py `triton_load`, a compile-time argument):
a quantized slot is read as stored and decoded in registers, and the plain format's load is the
bare tile load. A format that computes a tile's dot product with the vector itself (`triton_dot`:
int4, whose two weights a byte would otherwise be interleaved back into order) is called instead,
each program then keeping one sum per row rather than a tile of partial products. Everything accumulates in fp32 and is cast to x's dtype once, at the end. No host sync, no
data-dependent shape: CUDA graphs capture it. H and I are compile-time constants (one compile
per model shape; masks vanish where the tiles divide them); a chunk's length is not, so that
token counts choosing other chunks compile nothing new (Triton's interpreter, which the CPU tests
run, takes such a loop bound from 3.9 on). Triton is imported guarded, so the package
imports where it is absent (CPU CI); the torch path in compute.py stays the reference.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cache

import torch

from moe_serve.engine.experts.layout import ExpertLayout

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.activation import gated_activation
except ImportError:  # no triton: compute.py keeps the torch path
    triton = None

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class FusedConfig:
    """Tile sizes: rows of a weight matrix per program × contiguous elements per loop step."""
    gate_up_rows: int = 8  # rows of I per gate/up program (it reads a gate and an up tile)
    gate_up_cols: int = 512  # elements of H per step: 16 B loads, several per thread in flight
    gate_up_warps: int = 4
    down_rows: int = 4  # outputs of H per down program: T * H / 4 programs
    down_cols: int = 1024  # elements of I per step
    down_warps: int = 4
    down_splits: int | None = None  # chunks of I per down row block; None: down_splits() of the shape


# Programs a kernel launch should have to keep every SM of an H100/H200 (132) busy a few deep: the
# GEMVs are bound by the loads each program keeps in flight, so fewer, longer programs leave HBM idle.
# On an H200 the bench model's down matrices (H 256: 32 programs of 8 rows at one token) took 0.56 ms
# for 30 MB an expert, five times their gate/up (bench/results/quant/step-profile-int4-33-h200-before-splits.json)
MIN_PROGRAMS = 512


# tiles where the format has a triton_dot: a program then holds one sum per row, not a tile of
# partial products. An H200 exploration of int4's word dot (Mixtral-size layer call, 8 tile sets of
# 8-32 rows x 512-4096 columns x 4-8 warps, at 1 and 4 tokens) found these best or within 2% of
# the best at both: 0.103 ms at one token against 0.111 under the tiles of the byte dot before it
# (and still the best, with one chunk of I, for the subnormal-FMA dot after it: 0.079 ms,
# bench/results/quant/quant_sweep-int4-subnormal.json)
DOT_CONFIG = FusedConfig(gate_up_rows=8, gate_up_cols=2048, gate_up_warps=4, down_rows=8, down_cols=1024,
                         down_warps=4)


def default_config(tokens: int, hidden: int, intermediate: int, gate_up_dot: bool = False,
                   down_dot: bool = False) -> FusedConfig:
    """One set of tiles, best or within ~2% of the best on H100 for OLMoE and Mixtral shapes at
    T = 1 and 4 (the sweep in bench/results/kernels/fused_experts.json, key "sweep"); DOT_CONFIG's
    for a matrix whose format has a triton_dot; clamped for small models."""
    gate_up, down = (DOT_CONFIG if dot else FusedConfig() for dot in (gate_up_dot, down_dot))
    cols = min(gate_up.gate_up_cols, triton.next_power_of_2(hidden))
    # a narrow H takes more rows per program, so that each still reads a tile of the same size
    rows = min(gate_up.gate_up_rows * gate_up.gate_up_cols // cols, triton.next_power_of_2(intermediate))
    return replace(gate_up, gate_up_rows=max(rows, gate_up.gate_up_rows), gate_up_cols=cols,
                   down_rows=down.down_rows, down_cols=min(down.down_cols, triton.next_power_of_2(intermediate)),
                   down_warps=down.down_warps)


@cache  # a search over up to I's tiles, asked at every eager layer call with the same few shapes
def down_splits(row_blocks: int, intermediate: int, block_i: int, min_programs: int = MIN_PROGRAMS) -> int:
    """Chunks to cut I into so that row_blocks * chunks programs reach min_programs: the fewest that
    do and divide I's tiles evenly (every chunk then loops over the same whole tiles), at most one a tile."""
    tiles = -(-intermediate // block_i)
    return next(n for n in range(1, tiles + 1) if tiles % n == 0 and (row_blocks * n >= min_programs or n == tiles))


def chunk_length(intermediate: int, block_i: int, splits: int) -> int:
    """Elements of I per chunk when I is cut into `splits` chunks of whole tiles of block_i."""
    tiles = -(-intermediate // block_i)
    assert tiles % splits == 0, f"{splits} chunks do not divide I's {tiles} tiles"
    return tiles // splits * block_i


def fused_experts_available(device: torch.device | str) -> bool:
    """Triton is importable and `device` is a GPU it compiles for."""
    return triton is not None and torch.device(device).type == "cuda"


def fused_experts_supported(x: torch.Tensor, slots: torch.Tensor, layout: ExpertLayout) -> bool:
    """The fused path applies: a GPU, triton, a dtype it accumulates in fp32 without loss, packed
    rows of the layout computing in x's dtype."""
    return (fused_experts_available(x.device) and x.dtype in SUPPORTED_DTYPES and layout.dtype == x.dtype
            and slots.dtype == layout.row_dtype and slots.stride(1) == 1)


def fused_experts(
    x: torch.Tensor, expert_weights: torch.Tensor, slots: torch.Tensor, slot_ids: torch.Tensor,
    layout: ExpertLayout, config: FusedConfig | None = None,
) -> torch.Tensor:
    """Same contract as compute.gathered_experts: x [T, H]; expert_weights/slot_ids [T, k];
    slots [S, numel] packed rows. Returns sum_j weight_j * expert_j(x) as [T, H] in x's dtype."""
    t, k = slot_ids.shape
    h, i = layout.hidden_size, layout.intermediate_size
    cfg = config or default_config(t, h, i, *(layout.format_of(m).triton_dot is not None for m in ("gate_up", "down")))
    x = x.contiguous()
    ids = slot_ids.reshape(-1).contiguous()  # [T*k]
    weights = expert_weights.reshape(-1).contiguous()  # [T*k]
    act = torch.empty(t * k, i, dtype=torch.float32, device=x.device)  # [T*k, I]
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)  # [T, H]
    if t * k:  # k == 0 (every expert of the token left to the CPU): the down kernel writes zeros
        _gate_up_kernel[(t * k, triton.cdiv(i, cfg.gate_up_rows))](
            x_ptr=x, **_with_dot(layout, slots, "gate_up"), ids_ptr=ids, act_ptr=act, H=h, I=i, K=k,
            BLOCK_I=cfg.gate_up_rows, BLOCK_H=cfg.gate_up_cols, **layout.activation.kernel_args,
            num_warps=cfg.gate_up_warps,
        )
    row_blocks = triton.cdiv(h, cfg.down_rows)
    splits = cfg.down_splits or down_splits(t * row_blocks, i, cfg.down_cols)
    partial = out if splits == 1 else torch.empty(splits, t, h, dtype=torch.float32, device=x.device)  # [splits, T, H]
    _down_kernel[(t, row_blocks, splits)](
        act_ptr=act, **_with_dot(layout, slots, "down"), ids_ptr=ids, weights_ptr=weights, out_ptr=partial,
        i_chunk=chunk_length(i, cfg.down_cols, splits), H=h, I=i, K=k, BLOCK_H=cfg.down_rows, BLOCK_I=cfg.down_cols,
        PARTIAL=splits > 1, num_warps=cfg.down_warps,
    )
    if splits > 1:
        sum_partials(partial, out, 1)
    return out


def sum_partials(partial: torch.Tensor, out: torch.Tensor, k: int) -> None:
    """out [T, H] = the sum over each token's k pairs (token * k + j) and over the chunks of I of
    partial [splits, T*k, H] (fp32), pairs in routing order, each SPLIT_BLOCK chunks' tile summed
    in the tree order tl.sum compiles to, tiles in order: deterministic."""
    splits, pairs, h = partial.shape
    block_h = min(1024, triton.next_power_of_2(h))
    # chunks are read SPLIT_BLOCK at a time (4096 values a program), not one by one: a chain of
    # dependent loads per chunk took 250 us an H200 step of 6 layers x 32 chunks x 2 pairs at H 256
    _sum_partials_kernel[(pairs // k, triton.cdiv(h, block_h))](partial, out, pairs, splits, H=h, K=k,
                                                               BLOCK_H=block_h, SPLIT_BLOCK=4096 // block_h)


def matrix_operands(layout: ExpertLayout, slots: torch.Tensor, matrix: str) -> dict:
    """The expert kernels' arguments for one matrix ('gate_up' or 'down'): the slots [S, numel] as
    its data, its scales and its bias, their row strides, where its sections start, its format's load
    with the order of a loaded tile's columns, and whether it has a bias (without, the bias pointer
    and stride are None: compile-time constants, so the kernels compile as if they had none)."""
    w, s = layout.kernel_views(slots, matrix)  # [S, *]
    b = layout.bias_kernel_view(slots)  # [S, *] or None
    return {"w_ptr": w, "s_ptr": s, "b_ptr": b, "row_stride": w.stride(0), "scale_stride": s.stride(0),
            "bias_stride": None if b is None else b.stride(0),
            "DATA": layout.element_offset(matrix), "SCALES": layout.element_offset(matrix + ".scales"),
            "BIAS": layout.element_offset(matrix + ".bias"), "BIASES": layout.biases,
            "LOAD": layout.format_of(matrix).triton_load, "COLS": layout.format_of(matrix).triton_cols}


def _with_dot(layout: ExpertLayout, slots: torch.Tensor, matrix: str) -> dict:
    """matrix_operands plus the format's tile dot, compiled in only where it has one (a constexpr
    function argument cannot be None)."""
    operands = matrix_operands(layout, slots, matrix)
    dot = layout.format_of(matrix).triton_dot
    return {**operands, "DOT": operands["LOAD"] if dot is None else dot, "USE_DOT": dot is not None}


if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, act_ptr, row_stride, scale_stride, bias_stride,
                        H: tl.constexpr, I: tl.constexpr, K: tl.constexpr, DATA: tl.constexpr,
                        SCALES: tl.constexpr, BIAS: tl.constexpr, BIASES: tl.constexpr, BLOCK_I: tl.constexpr,
                        BLOCK_H: tl.constexpr, LOAD: tl.constexpr, COLS: tl.constexpr, DOT: tl.constexpr,
                        USE_DOT: tl.constexpr, CLAMPED_SWIGLU: tl.constexpr, ALPHA: tl.constexpr,
                        LIMIT: tl.constexpr):
        pair = tl.program_id(0)  # token * K + j
        token = pair // K
        slot = tl.load(ids_ptr + pair).to(tl.int64)  # int64: slot * row_stride passes 2**31 on big caches
        gate_ptr = w_ptr + slot * row_stride + DATA  # gate_up [2I, H], gate rows first, in the format
        scale_ptr = s_ptr + slot * scale_stride + SCALES
        rows = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)  # [BLOCK_I]
        row_ok = rows < I
        if USE_DOT:
            g = tl.zeros([BLOCK_I], dtype=tl.float32)
            u = tl.zeros([BLOCK_I], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                g += DOT(gate_ptr, scale_ptr, rows, row_ok, h0, H, BLOCK_H, x_ptr + token * H)  # [BLOCK_I]
                u += DOT(gate_ptr, scale_ptr, rows + I, row_ok, h0, H, BLOCK_H, x_ptr + token * H)
        else:
            acc_gate = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_I, BLOCK_H], dtype=tl.float32)
            for h0 in range(0, H, BLOCK_H):
                col = COLS(h0, BLOCK_H)  # [BLOCK_H] x's elements in the order of the loaded tile's columns
                col_ok = col < H
                xv = tl.load(x_ptr + token * H + col, mask=col_ok, other=0.0).to(tl.float32)  # [BLOCK_H]
                gate = LOAD(gate_ptr, scale_ptr, rows, row_ok, h0, H, BLOCK_H, False, "evict_first")  # [BLOCK_I, BLOCK_H]
                up = LOAD(gate_ptr, scale_ptr, rows + I, row_ok, h0, H, BLOCK_H, False, "evict_first")
                acc_gate += gate.to(tl.float32) * xv[None, :]
                acc_up += up.to(tl.float32) * xv[None, :]
            g = tl.sum(acc_gate, axis=1)  # [BLOCK_I]
            u = tl.sum(acc_up, axis=1)
        if BIASES:  # gate_up's bias [2I], gate's first
            bias_ptr = b_ptr + slot * bias_stride + BIAS
            g += tl.load(bias_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            u += tl.load(bias_ptr + I + rows, mask=row_ok, other=0.0).to(tl.float32)
        tl.store(act_ptr + pair * I + rows, gated_activation(g, u, CLAMPED_SWIGLU, ALPHA, LIMIT), mask=row_ok)

    @triton.jit
    def _down_kernel(act_ptr, w_ptr, s_ptr, b_ptr, ids_ptr, weights_ptr, out_ptr, row_stride, scale_stride,
                     bias_stride, i_chunk, H: tl.constexpr, I: tl.constexpr, K: tl.constexpr, DATA: tl.constexpr,
                     SCALES: tl.constexpr, BIAS: tl.constexpr, BIASES: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_I: tl.constexpr, PARTIAL: tl.constexpr, LOAD: tl.constexpr, COLS: tl.constexpr,
                     DOT: tl.constexpr, USE_DOT: tl.constexpr):
        token = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H] outputs
        row_ok = rows < H
        first = tl.program_id(2) * i_chunk  # this program's chunk of I: whole tiles
        y = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):  # the k experts in routing order: a fixed summation order
            pair = token * K + j
            slot = tl.load(ids_ptr + pair).to(tl.int64)
            down_ptr = w_ptr + slot * row_stride + DATA  # down [H, I], in the format
            scale_ptr = s_ptr + slot * scale_stride + SCALES
            if USE_DOT:
                dots = tl.zeros([BLOCK_H], dtype=tl.float32)
                for step in range(0, i_chunk, BLOCK_I):
                    dots += DOT(down_ptr, scale_ptr, rows, row_ok, first + step, I, BLOCK_I,
                                act_ptr + pair * I)  # [BLOCK_H]
            else:
                acc = tl.zeros([BLOCK_H, BLOCK_I], dtype=tl.float32)
                for step in range(0, i_chunk, BLOCK_I):
                    i0 = first + step
                    col = COLS(i0, BLOCK_I)  # [BLOCK_I] in the order of the loaded tile's columns
                    col_ok = col < I
                    a = tl.load(act_ptr + pair * I + col, mask=col_ok, other=0.0)  # [BLOCK_I] fp32
                    w = LOAD(down_ptr, scale_ptr, rows, row_ok, i0, I, BLOCK_I, False, "evict_first")  # [BLOCK_H, BLOCK_I]
                    acc += w.to(tl.float32) * a[None, :]
                dots = tl.sum(acc, axis=1)
            if BIASES:  # noqa: SIM102 - a compile-time test: without biases, b_ptr (None) must not be compiled in
                if tl.program_id(2) == 0:  # down's bias [H], part of the expert's output: added by one chunk
                    dots += tl.load(b_ptr + slot * bias_stride + BIAS + rows, mask=row_ok, other=0.0).to(tl.float32)
            y += tl.load(weights_ptr + pair).to(tl.float32) * dots
        if PARTIAL:  # out_ptr is the fp32 partial [splits, T, H]
            tl.store(out_ptr + (tl.program_id(2) * tl.num_programs(0) + token) * H + rows, y, mask=row_ok)
        else:  # out_ptr is the output [T, H]
            tl.store(out_ptr + token * H + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _sum_partials_kernel(partial_ptr, out_ptr, pairs, splits, H: tl.constexpr, K: tl.constexpr,
                             BLOCK_H: tl.constexpr, SPLIT_BLOCK: tl.constexpr):
        token = tl.program_id(0)
        outs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        out_ok = outs < H
        total = tl.zeros([BLOCK_H], dtype=tl.float32)
        for j in tl.static_range(K):  # the k experts in routing order, each over its chunks of I in order
            for first in range(0, splits, SPLIT_BLOCK):
                split = first + tl.arange(0, SPLIT_BLOCK)  # [SPLIT_BLOCK] chunks, summed as one tile
                part = tl.load(partial_ptr + (split[:, None] * pairs + token * K + j) * H + outs[None, :],
                               mask=(split[:, None] < splits) & out_ok[None, :], other=0.0)
                total += tl.sum(part, axis=0)
        tl.store(out_ptr + token * H + outs, total.to(out_ptr.dtype.element_ty), mask=out_ok)
