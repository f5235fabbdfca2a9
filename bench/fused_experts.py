"""Decode-time expert compute: torch gathered (index_select + bmm) vs the fused Triton kernel.

One device call:
    python bench/fused_experts.py --out $OUT/fused_experts.json [--sweep]
Per shape and T, both paths are captured in CUDA graphs over `layers` calls, each call on its
own layer's slot buffer with distinct slots for every (token, j) while T*k <= experts (so
little is served from L2), and timed as the median of CUDA-event-timed replays. GB/s = T*k
expert rows / time per call, against a device-to-device copy measured in the same run; both
paths read every (token, j) row, repeated experts included. --sweep also times the kernel's
tile configurations, one kernel's at a time, then every number of chunks the down GEMV can cut I
into (`down_splits`: what MIN_PROGRAMS should be per format and shape).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from moe_serve.engine.experts.activation import ExpertActivation  # noqa: E402
from moe_serve.engine.experts.compute import gathered_experts_torch  # noqa: E402
from moe_serve.engine.experts.fused_experts import FusedConfig, default_config, fused_experts  # noqa: E402
from moe_serve.engine.experts.layout import ExpertLayout  # noqa: E402


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    intermediate: int
    experts: int
    top_k: int
    layers: int  # calls per captured graph, one slot buffer each
    gpt_oss: bool = False  # experts with biases and the clamped SwiGLU

    def layout(self, dtype: torch.dtype, fmt=None) -> ExpertLayout:
        """The shape's expert layout, its weights in `fmt` (None: dtype)."""
        options = {"activation": ExpertActivation("clamped_swiglu"), "biases": True} if self.gpt_oss else {}
        return ExpertLayout(self.hidden, self.intermediate, dtype, fmt, **options)


SHAPES = [
    Shape("olmoe-1b-7b", hidden=2048, intermediate=1024, experts=64, top_k=8, layers=16),
    Shape("mixtral-8x7b", hidden=4096, intermediate=14336, experts=8, top_k=2, layers=4),
    # the end-to-end benches' Mixtral-size model (bench/checkpoints.py expanded_default: the default
    # model's H 256, its experts widened to 352 MB): few outputs, a very wide I
    Shape("default-352mb", hidden=256, intermediate=229376, experts=8, top_k=2, layers=4),
    # gpt-oss-20b's experts (gpt-oss-120b's are the same, 128 of them): biases, the clamped SwiGLU
    Shape("gpt-oss-20b", hidden=2880, intermediate=2880, experts=32, top_k=4, layers=8, gpt_oss=True),
]
GATE_UP_SWEEP = [(4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 128, 4), (16, 256, 4), (16, 512, 4),
                 (16, 512, 8), (32, 128, 4), (32, 256, 4), (32, 512, 8)]  # rows, cols, warps
DOWN_SWEEP = [(2, 1024, 4), (4, 512, 4), (4, 1024, 4), (4, 2048, 8), (8, 256, 4), (8, 512, 4),
              (8, 1024, 8), (16, 256, 4), (16, 512, 4), (32, 256, 8)]


class Problem:
    """`layers` slot buffers and, per layer, T tokens' distinct slot ids: one decode step's experts."""

    def __init__(self, shape: Shape, tokens: int, seed: int = 0, device: str = "cuda") -> None:
        gen = torch.Generator(device=device).manual_seed(seed)
        self.layout = shape.layout(torch.bfloat16)
        self.slots = [torch.empty(shape.experts, self.layout.numel, dtype=torch.bfloat16, device=device)
                      .normal_(0, shape.hidden**-0.5, generator=gen) for _ in range(shape.layers)]
        pairs = tokens * shape.top_k
        self.ids = [torch.randperm(shape.experts, generator=gen, device=device)[torch.arange(pairs, device=device)
                    % shape.experts].view(tokens, shape.top_k) for _ in range(shape.layers)]  # [T, k] each
        self.x = torch.randn(tokens, shape.hidden, generator=gen, device=device).to(torch.bfloat16)  # [T, H]
        self.weights = torch.rand(tokens, shape.top_k, generator=gen, device=device).softmax(-1)  # [T, k]
        self.bytes_per_call = pairs * self.layout.nbytes

    def step(self, expert_fn) -> torch.Tensor:
        y = self.x
        for slots, ids in zip(self.slots, self.ids):
            y = expert_fn(y, self.weights, slots, ids, self.layout)
        return y


def graph_ms_per_call(problem: Problem, expert_fn, calls: int, replays: int = 30) -> float:
    """Median over replays of one captured step, divided by its calls."""
    problem.step(expert_fn)  # compile / warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        problem.step(expert_fn)
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return statistics.median(times) / calls


def copy_gbps(nbytes: int = 2**30) -> float:
    """Device-to-device copy, bytes read + written per second: what HBM sustains here."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return 2 * nbytes / statistics.median(times) / 1e6


def fused_with(config: FusedConfig):
    return lambda x, w, s, i, layout: fused_experts(x, w, s, i, layout, config=config)


def _best_tile(timings: dict[str, float]) -> tuple[int, int, int]:
    """(rows, cols, warps) of the fastest "RxCwW" key."""
    rows, rest = min(timings, key=timings.get).split("x")
    cols, warps = rest.split("w")
    return int(rows), int(cols), int(warps)


def sweep(problem: Problem, shape: Shape, tokens: int, deadline: float, gate_up_grid=GATE_UP_SWEEP,
          down_grid=DOWN_SWEEP) -> dict:
    """Gate/up tiles under the default down tiles, then down tiles under the best gate/up ones, then
    every number of chunks of I (FusedConfig.down_splits) under the best of both."""
    base = default_config(tokens, shape.hidden, shape.intermediate)
    result: dict = {"gate_up": {}, "down": {}, "down_splits": {}}
    for rows, cols, warps in gate_up_grid:
        if time.monotonic() > deadline:
            break
        cfg = replace(base, gate_up_rows=rows, gate_up_cols=cols, gate_up_warps=warps)
        result["gate_up"][f"{rows}x{cols}w{warps}"] = graph_ms_per_call(problem, fused_with(cfg), shape.layers, 10)
    if result["gate_up"]:
        rows, cols, warps = _best_tile(result["gate_up"])
        base = replace(base, gate_up_rows=rows, gate_up_cols=cols, gate_up_warps=warps)
    for rows, cols, warps in down_grid:
        if time.monotonic() > deadline:
            break
        cfg = replace(base, down_rows=rows, down_cols=cols, down_warps=warps)
        result["down"][f"{rows}x{cols}w{warps}"] = graph_ms_per_call(problem, fused_with(cfg), shape.layers, 10)
    if result["down"]:
        rows, cols, warps = _best_tile(result["down"])
        base = replace(base, down_rows=rows, down_cols=cols, down_warps=warps)
    tiles = -(-shape.intermediate // base.down_cols)
    for splits in (n for n in range(1, tiles + 1) if tiles % n == 0):
        if time.monotonic() > deadline:
            break
        cfg = replace(base, down_splits=splits)
        result["down_splits"][str(splits)] = graph_ms_per_call(problem, fused_with(cfg), shape.layers, 10)
    return result


def row(shape: Shape, tokens: int, hbm_gbps: float, do_sweep: bool, sweep_seconds: float) -> dict:
    problem = Problem(shape, tokens)
    torch_ms = graph_ms_per_call(problem, gathered_experts_torch, shape.layers)
    fused_ms = graph_ms_per_call(problem, fused_experts, shape.layers)
    ref, got = (fn(problem.x, problem.weights, problem.slots[0], problem.ids[0], problem.layout).float()
                for fn in (gathered_experts_torch, fused_experts))  # [T, H] each, one call
    gb = problem.bytes_per_call / 1e9
    result = {
        "shape": asdict(shape), "tokens": tokens, "expert_rows_per_call": tokens * shape.top_k,
        "gb_per_call": gb, "config": asdict(default_config(tokens, shape.hidden, shape.intermediate)),
        "torch_gathered_ms": torch_ms, "fused_ms": fused_ms, "speedup": torch_ms / fused_ms,
        "torch_gathered_gbps": gb / torch_ms * 1e3, "fused_gbps": gb / fused_ms * 1e3,
        "floor_ms_at_copy_bandwidth": gb / hbm_gbps * 1e3,
        "max_abs_diff_over_max_abs": ((ref - got).abs().max() / ref.abs().max()).item(),
    }
    if do_sweep:
        result["sweep_ms"] = sweep(problem, shape, tokens, time.monotonic() + sweep_seconds)
    del problem
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", default="1,4,8")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-seconds", type=float, default=30, help="per shape and T, then no new config")
    args = parser.parse_args()
    hbm = copy_gbps()
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": __import__("triton").__version__,
              "copy_gbps_read_plus_write": hbm, "rows": []}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    for shape in SHAPES:
        for tokens in map(int, args.tokens.split(",")):
            result["rows"].append(row(shape, tokens, hbm, args.sweep, args.sweep_seconds))
            print(json.dumps({k: v for k, v in result["rows"][-1].items() if k not in ("shape", "config")}),
                  flush=True)
            Path(args.out).write_text(json.dumps(result, indent=2))  # after every row: a timeout keeps the rest

if __name__ == "__main__":
    main()
