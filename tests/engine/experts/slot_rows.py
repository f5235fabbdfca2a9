"""Random experts encoded into cache-slot rows of any format (or two), for the kernel tests; test shapes
grown to a block format's whole blocks; the exact reference the GPU kernels are held to."""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from moe_serve.engine.experts.activation import ExpertActivation
from moe_serve.engine.experts.formats import FORMAT_NAMES, expert_format
from moe_serve.engine.experts.layout import MATRICES, ExpertLayout


# a layout whose down projection has another format than gate/up ("gate_up+down" in the quant
# arguments below): int4's tile dot on one matrix, q8_0's loads (no scales) on the other
MIXED_FORMATS = ["int4+q8_0"]

# gpt-oss's experts: biases and the clamped SwiGLU of its config (swiglu_alpha, swiglu_limit)
GPT_OSS_EXPERTS = {"activation": ExpertActivation("clamped_swiglu", alpha=1.702, limit=7.0), "biases": True}
# inputs x ~ N(0, 4^2) against weights ~ N(0, 1/H) and biases ~ N(0, 1): gate and up ~ N(0, 17), past
# the limit of 7 in ~9% of places, so that the clamps bind (clamp_binds)
GPT_OSS_INPUT_SCALE = 4.0


def quant_layout(h: int, i: int, dtype: torch.dtype, quant: str, **options: Any) -> ExpertLayout:
    """The layout of a test's `quant`: a format name, or 'gate_up+down' names; options: ExpertLayout's
    others (GPT_OSS_EXPERTS)."""
    return ExpertLayout(h, i, dtype, *(expert_format(name, dtype) for name in quant.split("+")), **options)


def random_slots(layout: ExpertLayout, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """num_slots experts with weights ~ N(0, 1/fan_in), encoded in the layout's format, and biases
    ~ N(0, 1) where it has them: [S, numel]."""
    h, i = layout.hidden_size, layout.intermediate_size
    slots = torch.zeros(num_slots, layout.numel, dtype=layout.row_dtype)
    layout.write(slots, "gate_up", torch.randn(num_slots, 2 * i, h, generator=gen) / h**0.5)
    layout.write(slots, "down", torch.randn(num_slots, h, i, generator=gen) / i**0.5)
    if layout.biases:
        layout.write(slots, "gate_up_bias", torch.randn(num_slots, 2 * i, generator=gen))
        layout.write(slots, "down_bias", torch.randn(num_slots, h, generator=gen))
    return slots


def clamp_binds(layout: ExpertLayout, slots: torch.Tensor, x: torch.Tensor, slot_ids: torch.Tensor) -> bool:
    """Whether the routed experts' gate passes the clamped SwiGLU's limit somewhere and up its bounds
    too (either side): a test whose clamps never bind checks nothing of them."""
    limit, ids = layout.activation.limit, slot_ids.reshape(-1)
    rows = slots[ids].cpu()
    gate_up = torch.einsum("pnh,ph->pn", layout.gate_up(rows).float(),
                           x.repeat_interleave(slot_ids.shape[1], dim=0).float().cpu())
    gate, up = (gate_up + layout.bias(rows, "gate_up").float()).chunk(2, dim=-1)
    return bool((gate > limit).any() and (up > limit).any() and (up < -limit).any())


def followed_by_nans(x: torch.Tensor) -> torch.Tensor:
    """x (contiguous) in storage whose following elements are NaN: a kernel tile that overhangs x's
    last row and reads the vector past it (memory of other tensors, or none) turns the output NaN
    instead of passing by luck."""
    padded = torch.full((x.numel() + 4096,), float("nan"), dtype=x.dtype, device=x.device)  # wider than any tile
    padded[:x.numel()] = x.flatten()
    return padded[:x.numel()].view_as(x)


def interpreted_formats() -> list[str]:
    """The quantized formats whose whole kernels the Triton interpreter runs on CPU: blocks of at
    most 32 weights. Larger blocks grow the cases to 256 x 256, minutes each in the interpreter; their
    loads are checked tile by tile in formats/test_triton_loads.py, their kernels on the GPU."""
    formats = [(name, expert_format(name, torch.float32)) for name in FORMAT_NAMES if name not in ("none", *_SHARED_LOADS)]
    return [name for name, fmt in formats if max(fmt.row_multiple, fmt.col_multiple) <= 32]


# Whole-kernel runs that would add nothing but minutes: GGUF's first four types share one load
# (legacy_quants._load_legacy, switched by constants), for which q5_1, with both the min and the
# fifth bit, stands; and the kernels call every load of a 32-weight block alike (q8_0 and q5_1 run
# them), so iq4_nl's differs from theirs only inside its load. Every load is checked tile by tile in
# formats/test_triton_loads.py
_SHARED_LOADS = ("q4_0", "q4_1", "q5_0", "iq4_nl")


def fitted_cases(cases: list[tuple[int, ...]], quant: str) -> list[tuple[int, ...]]:
    """(H, I, ...) cases with H and I rounded up to the format's whole blocks (both are a row count
    and a reduction dim, of gate_up and down)."""
    formats = [expert_format(name, torch.float32) for name in quant.split("+")]
    step = math.lcm(*(m for fmt in formats for m in (fmt.row_multiple, fmt.col_multiple)))
    return [(-(-h // step) * step, -(-i // step) * step, *rest) for h, i, *rest in cases]


def tile_plan(cases: list[tuple[int, ...]], default_tile_cases: list[tuple[int, ...]],
              small_tiles: Callable[[int, int], Any]) -> list[tuple[tuple[int, ...], tuple]]:
    """(H, I, ...) cases with the kernel configs to run each under: small tiles (small_tiles(H, I)) and
    the defaults (None); `default_tile_cases` under the defaults only (the interpreter is slow)."""
    return [(case, (small_tiles(*case[:2]), None)) for case in cases] + [(case, (None,)) for case in default_tile_cases]


def decoded_reference(layout: ExpertLayout, slots: torch.Tensor, multiplied: torch.dtype) -> tuple[ExpertLayout, torch.Tensor]:
    """Plain fp32 rows of the weights a kernel multiplies, the slots decoded to `multiplied` (bf16
    where tl.dot takes them, fp32 where a GEMV multiplies in registers): fp32 math over them is what
    the kernel must match up to its fp32 accumulation."""
    exact = replace(layout, dtype=torch.float32, format=None, down_format=None)  # same activation and biases
    decode = ExpertLayout(layout.hidden_size, layout.intermediate_size, multiplied, layout.format, layout.down_format)
    rows = torch.empty(len(slots), exact.numel, device=slots.device)
    for matrix in MATRICES:
        exact.write(rows, matrix, decode.weights(slots, matrix).float())
        if layout.biases:  # read through the layout's own dtype: the bias sections' place and size depend on it
            exact.write(rows, matrix + "_bias", layout.bias(slots, matrix).float())
    return exact, rows
