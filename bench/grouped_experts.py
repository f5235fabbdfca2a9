"""Batched decode expert compute: the per-pair fused GEMVs vs the grouped kernel, by batch size.

One device call:
    python bench/grouped_experts.py --out $OUT/grouped_experts.json [--sweep block_m,gate_up,down]
Per shape and T, each path is captured in a CUDA graph over `layers` calls, each call on its own
layer's slot buffer (so little is served from L2), and timed as the median of CUDA-event-timed
replays. Every token routes to k distinct experts drawn uniformly (real routers are skewed,
which only favours the grouped kernel). GB/s counts the distinct experts' bytes: what a kernel
that reads each routed expert once must move. The crossover picks compute.GROUPED_MIN_PAIRS.
--sweep also times grouped tile configurations at the larger batches.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fused_experts import SHAPES, Shape, copy_gbps, graph_ms_per_call  # noqa: E402
from moe_serve.engine.experts.compute import gathered_experts_torch  # noqa: E402
from moe_serve.engine.experts.fused_experts import fused_experts  # noqa: E402
from moe_serve.engine.experts.grouped_experts import (  # noqa: E402
    GroupedConfig,
    block_layout,
    default_config,
    grouped_experts,
    kernels_for,
)

SWEEP = {  # field overrides of GroupedConfig, one kernel's at a time
    "block_m": [{"block_m": 32}, {"block_m": 64}],
    "gate_up": [{"gate_up_block_i": bi, "gate_up_block_h": bh, "gate_up_warps": w, "gate_up_stages": s}
                for bi, bh, w, s in [(32, 128, 4, 4), (64, 64, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4),
                                     (128, 128, 8, 3), (32, 256, 4, 4), (64, 128, 4, 3), (64, 128, 4, 5)]],
    "down": [{"down_block_h": bh, "down_block_i": bi, "down_warps": w, "down_stages": s}
             for bh, bi, w, s in [(32, 128, 4, 4), (64, 64, 4, 4), (64, 256, 4, 3), (128, 64, 4, 4),
                                  (128, 128, 8, 3), (32, 256, 4, 4), (64, 128, 4, 3), (64, 128, 4, 5)]],
}


class Problem:
    """`layers` slot buffers of every expert, and per layer T tokens' top-k distinct slots."""

    def __init__(self, shape: Shape, tokens: int, seed: int = 0, device: str = "cuda") -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layout = shape.layout(torch.bfloat16)
        self.slots = [torch.empty(shape.experts, self.layout.numel, dtype=torch.bfloat16, device=device)
                      .normal_(0, shape.hidden**-0.5, generator=gen) for _ in range(shape.layers)]
        self.ids = [torch.rand(tokens, shape.experts, generator=gen, device=device).argsort(-1)[:, : shape.top_k]
                    for _ in range(shape.layers)]  # [T, k] each
        self.x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(torch.bfloat16)  # [T, H]
        self.weights = torch.rand(tokens, shape.top_k, generator=gen, device=device).softmax(-1)  # [T, k]
        distinct = sum(ids.unique().numel() for ids in self.ids) / shape.layers
        self.distinct_experts = distinct
        self.distinct_bytes = distinct * self.layout.nbytes

    def step(self, expert_fn) -> torch.Tensor:
        y = self.x
        for slots, ids in zip(self.slots, self.ids):
            y = expert_fn(y, self.weights, slots, ids, self.layout)
        return y


def grouped_with(config: GroupedConfig):
    return lambda x, w, s, i, layout: grouped_experts(x, w, s, i, layout, config=config)


def layout_only(x, w, slots, ids, layout):
    """The sort-and-block step alone: its share of a grouped call."""
    block_layout(ids, slots.shape[0], 16)
    return x


def sweep(problem: Problem, shape: Shape, kernels: list[str], deadline: float, grid=SWEEP) -> dict:
    """Each kernel's tiles under the best found so far, in the order of `grid` (SWEEP by default),
    from the tiles of the kernels the problem's experts run (kernels_for: grouped_int4.py's for int4)."""
    best = kernels_for(problem.x, problem.layout).config
    result: dict = {}
    for kernel, overrides in ((name, grid[name]) for name in kernels):
        times = {"default": graph_ms_per_call(problem, grouped_with(best), shape.layers, 10)}
        for fields in overrides:
            if time.monotonic() > deadline:
                break
            try:
                times[json.dumps(fields)] = graph_ms_per_call(problem, grouped_with(replace(best, **fields)),
                                                              shape.layers, 10)
            except triton.runtime.errors.OutOfResources:  # too many stages of too large tiles
                continue
        result[kernel] = times
        winner = min(times, key=times.get)
        if winner != "default":
            best = replace(best, **json.loads(winner))
    result["best"] = asdict(best)
    return result


def row(shape: Shape, tokens: int, hbm_gbps: float, sweep_kernels: list[str], sweep_seconds: float) -> dict:
    problem = Problem(shape, tokens)
    fused_ms = graph_ms_per_call(problem, fused_experts, shape.layers)
    grouped_ms = graph_ms_per_call(problem, grouped_experts, shape.layers)
    layout_ms = graph_ms_per_call(problem, layout_only, shape.layers)
    args = (problem.x, problem.weights, problem.slots[0], problem.ids[0], problem.layout)
    ref = gathered_experts_torch(*args).float()
    gb = problem.distinct_bytes / 1e9
    result = {
        "shape": shape.name, "tokens": tokens, "pairs": tokens * shape.top_k,
        "distinct_experts_per_layer": problem.distinct_experts,
        "config": asdict(default_config(shape.hidden, shape.intermediate)),
        "fused_ms": fused_ms, "grouped_ms": grouped_ms, "speedup": fused_ms / grouped_ms,
        "block_layout_ms": layout_ms,
        "grouped_gbps_distinct": gb / grouped_ms * 1e3, "floor_ms_at_copy_bandwidth": gb / hbm_gbps * 1e3,
        "grouped_max_abs_diff_over_max_abs": ((ref - grouped_experts(*args).float()).abs().max()
                                              / ref.abs().max()).item(),
        "fused_max_abs_diff_over_max_abs": ((ref - fused_experts(*args).float()).abs().max() / ref.abs().max()).item(),
    }
    if sweep_kernels:
        result["sweep_ms"] = sweep(problem, shape, sweep_kernels, time.monotonic() + sweep_seconds)
    del problem
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="1,2,4,8,16,32,64")
    parser.add_argument("--shapes", default=",".join(s.name for s in SHAPES))
    parser.add_argument("--sweep", default="", help=f"comma-separated, of {','.join(SWEEP)}")
    parser.add_argument("--sweep-tokens", default="32")
    parser.add_argument("--sweep-seconds", type=float, default=60, help="per shape and T, then no new config")
    args = parser.parse_args()
    hbm = copy_gbps()
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "copy_gbps_read_plus_write": hbm, "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    sweep_tokens = set(map(int, args.sweep_tokens.split(",")))
    for shape in (s for s in SHAPES if s.name in args.shapes.split(",")):
        for tokens in map(int, args.tokens.split(",")):
            kernels = [name for name in args.sweep.split(",") if name] if tokens in sweep_tokens else []
            result["rows"].append(row(shape, tokens, hbm, kernels, args.sweep_seconds))
            print(json.dumps({k: v for k, v in result["rows"][-1].items() if k != "config"}), flush=True)
            Path(args.out).write_text(json.dumps(result, indent=2))  # after every row: a timeout keeps the rest


if __name__ == "__main__":
    main()
