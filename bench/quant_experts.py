"""Quantized experts in the kernels: each --expert-quant format against bf16, at bs=1 and bs=32.

One device call:
    python bench/quant_experts.py --out $OUT/quant_experts.json
Per shape (OLMoE and Mixtral size) the same random bf16 experts (N(0, 1/H)) are encoded in every
format, so all formats compute the same model. Per format and T, the fused GEMV kernel, the
grouped kernel and the dispatch the engine takes (compute.gathered_experts) are each captured in
a CUDA graph over `layers` calls, one layer's slot buffer each (little is served from L2), and
timed as the median of CUDA-event-timed replays; every token routes to k distinct experts drawn
uniformly, as bench/grouped_experts.py does. GB/s counts the distinct experts' bytes in the
format: what a kernel reading each routed expert once must move, so a memory-bound format's
speedup over bf16 should approach its byte ratio (int4 ~3.9x, int8 and fp8 ~2x). Errors: against
fp32 math on the same quantized rows (the kernel's own error), and against the bf16 experts'
output (what the format costs).

--sweep: per quantized format, at the Mixtral shape (or each of --shapes where given), the fused
kernel's tiles and chunks of I at T = 1 and the grouped kernel's tiles at T = 32
(bench/fused_experts.py's and bench/grouped_experts.py's sweeps over grids of wider K steps: a
quantized tile of the bf16 defaults' width moves 1/2 or 1/4 the bytes per loop step). Written
under the key "sweeps", by shape.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import fused_experts as fused_bench  # noqa: E402
from bench import grouped_experts as grouped_bench  # noqa: E402
from bench.fused_experts import SHAPES, Shape, copy_gbps, graph_ms_per_call  # noqa: E402
from moe_serve.engine.experts.compute import accumulate_experts, gathered_experts  # noqa: E402
from moe_serve.engine.experts.formats import FORMAT_NAMES, expert_format  # noqa: E402
from moe_serve.engine.experts.fused_experts import fused_experts  # noqa: E402
from moe_serve.engine.experts.grouped_experts import grouped_experts  # noqa: E402
from moe_serve.engine.experts.layout import ExpertLayout  # noqa: E402

PATHS = {"fused": fused_experts, "grouped": grouped_experts, "dispatch": gathered_experts}
# (rows, cols, warps): K steps of 1-4x the bf16 defaults' 512 / 1024 elements
FUSED_GATE_UP_GRID = [(8, 512, 4), (8, 1024, 4), (8, 2048, 4), (8, 2048, 8), (16, 1024, 8), (16, 2048, 8),
                      (4, 2048, 4), (4, 4096, 8)]
FUSED_DOWN_GRID = [(4, 1024, 4), (4, 2048, 4), (4, 4096, 8), (2, 4096, 4), (2, 2048, 4), (8, 2048, 8), (8, 1024, 4)]
GROUPED_GRID = {
    "gate_up": [{"gate_up_block_i": bi, "gate_up_block_h": bh, "gate_up_warps": w, "gate_up_stages": st}
                for bi, bh, w, st in [(64, 256, 4, 3), (64, 256, 8, 3), (64, 512, 8, 2), (32, 512, 4, 3),
                                      (128, 256, 8, 3), (32, 256, 4, 4)]],
    "down": [{"down_block_h": bh, "down_block_i": bi, "down_warps": w, "down_stages": st}
             for bh, bi, w, st in [(64, 256, 4, 3), (64, 256, 8, 3), (64, 512, 8, 2), (32, 512, 4, 3),
                                   (128, 256, 8, 3), (32, 256, 4, 4)]],
}
SWEEP_SECONDS = 30  # per format and kernel, then no new config


class Problem:
    """`layers` slot buffers of every expert in one format, and per layer T tokens' top-k distinct slots."""

    def __init__(self, layout: ExpertLayout, slots: list[torch.Tensor], ids: list[torch.Tensor], x: torch.Tensor,
                 weights: torch.Tensor) -> None:
        self.layout, self.slots, self.ids, self.x, self.weights = layout, slots, ids, x, weights

    def step(self, expert_fn) -> torch.Tensor:
        y = self.x
        for slots, ids in zip(self.slots, self.ids):
            y = expert_fn(y, self.weights, slots, ids, self.layout)
        return y

    def first_call(self, expert_fn) -> torch.Tensor:
        return expert_fn(self.x, self.weights, self.slots[0], self.ids[0], self.layout)


def encoded_slots(shape: Shape, quant: str, plain: list[torch.Tensor]) -> tuple[ExpertLayout, list[torch.Tensor]]:
    """The bf16 experts of `plain` (one slot buffer per layer) re-encoded in format `quant`, one expert at a time."""
    bf16 = shape.layout(torch.bfloat16)
    if quant == "none":
        return bf16, plain
    layout = shape.layout(torch.bfloat16, expert_format(quant, torch.bfloat16))
    buffers = []
    for rows in plain:
        slots = torch.zeros(shape.experts, layout.numel, dtype=layout.row_dtype, device=rows.device)
        for expert in range(shape.experts):
            layout.write(slots[expert], "gate_up", bf16.gate_up(rows[expert]))
            layout.write(slots[expert], "down", bf16.down(rows[expert]))
            if layout.biases:
                layout.write(slots[expert], "gate_up_bias", bf16.bias(rows[expert], "gate_up"))
                layout.write(slots[expert], "down_bias", bf16.bias(rows[expert], "down"))
        buffers.append(slots)
    return layout, buffers


def fp32_reference(problem: Problem, quant: str) -> torch.Tensor:
    """The first call in fp32 math on the same stored weights (bf16 upcast, or quantized rows decoded
    to fp32), one expert decoded at a time: a Mixtral-size gather of T*k decoded rows would not fit."""
    layout = problem.layout
    fp32 = replace(layout, dtype=torch.float32, format=None if quant == "none" else layout.format)
    slots = problem.slots[0].float() if quant == "none" else _with_fp32_biases(layout, fp32, problem.slots[0])
    out = torch.zeros(problem.x.shape, dtype=torch.float32, device=problem.x.device)  # [T, H]
    rows = {e: slots[e] for e in problem.ids[0].unique().tolist()}
    accumulate_experts(out, problem.x.float(), problem.ids[0], problem.weights, rows, fp32)
    return out


def _with_fp32_biases(layout: ExpertLayout, fp32: ExpertLayout, slots: torch.Tensor) -> torch.Tensor:
    """Quantized slots as rows of `fp32` (their layout computing in fp32): the same weight bytes, and
    the biases, which a layout holds in its compute dtype, rewritten in fp32 (none: the same slots)."""
    if not layout.biases:
        return slots
    rows = torch.zeros(slots.shape[0], fp32.numel, dtype=fp32.row_dtype, device=slots.device)
    weights = layout.sections["gate_up.bias"].offset  # the weights and scales before the biases
    rows.view(torch.uint8)[:, :weights] = slots.view(torch.uint8)[:, :weights]
    for matrix in ("gate_up", "down"):
        fp32.write(rows, matrix + "_bias", layout.bias(slots, matrix).float())
    return rows


def random_problem_inputs(shape: Shape, tokens_list: list[int]) -> tuple[list[torch.Tensor], dict[int, tuple]]:
    """Seeded bf16 experts N(0, 1/H), one slot buffer per layer, and per T its routing: per layer
    T tokens' k distinct experts [T, k], the input x [T, H] and the routing weights [T, k]."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf16 = shape.layout(torch.bfloat16)
    plain = [torch.empty(shape.experts, bf16.numel, dtype=torch.bfloat16, device="cuda")
             .normal_(0, shape.hidden**-0.5, generator=gen) for _ in range(shape.layers)]
    routings = {}
    for tokens in tokens_list:
        ids = [torch.rand(tokens, shape.experts, generator=gen, device="cuda").argsort(-1)[:, : shape.top_k]
               for _ in range(shape.layers)]  # [T, k] each
        x = torch.randn(tokens, shape.hidden, generator=gen, device="cuda").to(torch.bfloat16)  # [T, H]
        weights = torch.rand(tokens, shape.top_k, generator=gen, device="cuda").softmax(-1)  # [T, k]
        routings[tokens] = (ids, x, weights)
    return plain, routings


def rows_for_shape(shape: Shape, tokens_list: list[int], hbm_gbps: float, formats: list[str]) -> list[dict]:
    bf16 = shape.layout(torch.bfloat16)
    plain, routings = random_problem_inputs(shape, tokens_list)
    rows, base_ms, base_out = [], {}, {}
    for quant in formats:
        layout, slots = encoded_slots(shape, quant, plain)
        for tokens, (ids, x, weights) in routings.items():
            problem = Problem(layout, slots, ids, x, weights)
            distinct = sum(i.unique().numel() for i in ids) / shape.layers
            gb = distinct * layout.nbytes / 1e9
            exact = fp32_reference(problem, quant)
            row = {"shape": shape.name, "format": layout.format.describe(), "quant": quant, "tokens": tokens,
                   "expert_bytes": layout.nbytes, "bytes_vs_bf16": layout.nbytes / bf16.nbytes,
                   "distinct_experts_per_layer": distinct, "floor_ms_at_copy_bandwidth": gb / hbm_gbps * 1e3}
            for name, fn in PATHS.items():
                ms = graph_ms_per_call(problem, fn, shape.layers)
                out = problem.first_call(fn).float()
                row[f"{name}_ms"] = ms
                row[f"{name}_gbps_distinct"] = gb / ms * 1e3
                row[f"{name}_max_abs_diff_over_max_abs_vs_fp32_same_rows"] = \
                    ((out - exact).abs().max() / exact.abs().max()).item()
                if quant == "none":
                    base_ms[(tokens, name)], base_out[(tokens, name)] = ms, out
                else:
                    row[f"{name}_speedup_vs_bf16"] = base_ms[(tokens, name)] / ms
                    ref = base_out[(tokens, name)]
                    row[f"{name}_rel_l2_vs_bf16_experts"] = ((out - ref).norm() / ref.norm()).item()
            rows.append(row)
            print(json.dumps(row), flush=True)
        del slots
        torch.cuda.empty_cache()
    return rows


def sweeps(shape: Shape, formats: list[str]) -> dict:
    """The quantized formats' tile sweeps at the given shape (see the module docstring)."""
    plain, routings = random_problem_inputs(shape, [1, 32])  # every format sweeps the same routings
    found = {}
    for quant in formats:
        layout, slots = encoded_slots(shape, quant, plain)
        problems = {tokens: Problem(layout, slots, *routing) for tokens, routing in routings.items()}
        found[quant] = {
            "fused_t1": fused_bench.sweep(problems[1], shape, 1, time.monotonic() + SWEEP_SECONDS,
                                          FUSED_GATE_UP_GRID, FUSED_DOWN_GRID),
            "grouped_t32": grouped_bench.sweep(problems[32], shape, ["gate_up", "down"],
                                               time.monotonic() + SWEEP_SECONDS, GROUPED_GRID),
        }
        print(json.dumps({quant: found[quant]}), flush=True)
        del slots, problems
        torch.cuda.empty_cache()
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="a JSON file; its name should contain 'quant'")
    parser.add_argument("--tokens", default="1,32")
    parser.add_argument("--shapes", default=None, help="default: every shape (--sweep: mixtral-8x7b)")
    parser.add_argument("--formats", default=",".join(FORMAT_NAMES), help="none (bf16) first: the baseline")
    parser.add_argument("--sweep", action="store_true", help="only the tile sweeps of the quantized formats")
    args = parser.parse_args()
    formats = args.formats.split(",")
    if formats[0] != "none":
        parser.error("--formats must start with none, the bf16 baseline the others are compared with")
    hbm = copy_gbps()
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "copy_gbps_read_plus_write": hbm, "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tokens = list(map(int, args.tokens.split(",")))
    names = args.shapes.split(",") if args.shapes else ["mixtral-8x7b"] if args.sweep else [s.name for s in SHAPES]
    if args.sweep:
        result["sweeps"] = {}
        for shape in (s for s in SHAPES if s.name in names):
            result["sweeps"][shape.name] = sweeps(shape, formats[1:])
            Path(args.out).write_text(json.dumps(result, indent=2))
        return
    for shape in (s for s in SHAPES if s.name in names):
        result["rows"] += rows_for_shape(shape, tokens, hbm, formats)
        Path(args.out).write_text(json.dumps(result, indent=2))  # after every shape: a timeout keeps the rest
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
