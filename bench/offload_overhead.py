"""Offloaded decode on the OLMoE-shaped checkpoint: prefetch none / next-layer x --cpu-experts off / auto.

One device call times the engine of this tree and, for the baseline, an older engine tree put
first on PYTHONPATH (this script then imports `engine` from there):
    python bench/offload_overhead.py rows --label after --rows none,none+eager,next-layer,none+cpu --out A.json
    PYTHONPATH=.before python bench/offload_overhead.py rows --label before --rows none,next-layer --out B.json
    python bench/offload_overhead.py profile --out P.json   # host time and the top kernels of one token
    python bench/offload_overhead.py ops --budget 100%      # which aten copies one static forward launches
    python bench/offload_overhead.py table B.json A.json
The checkpoint is bench/olmoe_shape.py's (random weights, built once on the GPU).
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # appended: a PYTHONPATH engine tree wins

import torch

import engine  # before bench.olmoe_shape, which puts this tree first on sys.path
from bench.olmoe_shape import OLMOE_SHAPE, build_checkpoint
from bench.rows import guarded, seeded_prompts, time_engine_decode
from engine.config import EngineConfig
from engine.loader import read_config


def _config(args: argparse.Namespace, row: str) -> EngineConfig:
    """A row is a prefetch mode plus options: +cpu (--cpu-experts auto), +eager (no CUDA graphs)."""
    prefetch, *options = row.split("+")
    extra = {"cpu_experts": "auto"} if "cpu" in options else {}  # the older engine has no such field
    if "eager" in options:
        extra["cuda_graphs"] = False
    return EngineConfig(model=args.checkpoint, device=args.device, max_model_len=1024, gpu_expert_budget=args.budget,
                        prefetch=prefetch, **extra)


def rows(args: argparse.Namespace) -> None:
    build_checkpoint(Path(args.checkpoint), OLMOE_SHAPE)
    prompts = seeded_prompts(read_config(args.checkpoint).vocab_size, args.prompts, args.prompt_len)
    results: list = []
    for row in args.rows.split(","):
        name = f"{args.label} {row}"
        guarded(results, name, lambda name=name, row=row: time_engine_decode(
            name, _config(args, row), prompts, args.tokens, deadline=time.perf_counter() + args.seconds))
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "engine": engine.__file__,
                                          "device": _device_name(args.device),
                                          "rows": [r.as_dict() for r in results]}, indent=2))


def profile(args: argparse.Namespace) -> None:
    """cProfile of the host and the GPU's busy time over a few offloaded one-token steps."""
    from engine.core import EngineCore, run_to_completion
    from engine.messages import GenerateRequest, SamplingParams

    build_checkpoint(Path(args.checkpoint), OLMOE_SHAPE)
    prompt = tuple(seeded_prompts(read_config(args.checkpoint).vocab_size, 1, args.prompt_len)[0])
    core = EngineCore(_config(args, args.rows.split(",")[0]))
    try:
        run_to_completion(core, GenerateRequest("warm", prompt, SamplingParams(max_tokens=args.tokens, temperature=0)))
        core.add_request(GenerateRequest("p", prompt, SamplingParams(max_tokens=args.tokens + 1, temperature=0)))
        core.step()  # the prefill, not profiled
        host = cProfile.Profile()
        activity = torch.profiler.ProfilerActivity.CUDA if args.device == "cuda" else torch.profiler.ProfilerActivity.CPU
        with torch.profiler.profile(activities=[activity]) as gpu:
            started = time.perf_counter()
            host.enable()
            while core.has_unfinished():
                core.step()  # each step ends in the sampled token's host sync
            host.disable()
            wall = time.perf_counter() - started
    finally:
        core.close()
    busy = sum(_device_us(e) for e in gpu.key_averages()) / 1e6
    text = io.StringIO()
    pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
    print(text.getvalue())
    kernels = sorted(gpu.key_averages(), key=_device_us, reverse=True)[:20]
    print("\n".join(f"{_device_us(e) / args.tokens:9.1f} us/token {e.count // args.tokens:5d}/token  {e.key[:90]}"
                    for e in kernels))
    summary = {"tokens": args.tokens, "ms_per_token": wall / args.tokens * 1e3,
               "gpu_busy_ms_per_token": busy / args.tokens * 1e3}
    print(json.dumps(summary))
    Path(args.out).write_text(json.dumps({**summary, "cprofile_tottime": text.getvalue()}, indent=2))


def ops(args: argparse.Namespace) -> None:
    """Which engine lines launch the step's copy and elementwise kernels: one eager static-shape
    decode forward under the profiler, aten ops grouped by the innermost engine frame and shapes."""
    from collections import Counter

    from engine.runtime import build_runtime

    build_checkpoint(Path(args.checkpoint), OLMOE_SHAPE)
    runtime = build_runtime(_config(args, args.rows.split(",")[0]))
    try:
        model, kv = runtime.target.model, runtime.target.kv
        device = model.device
        model(torch.arange(3, 3 + args.prompt_len, device=device), 0, kv)
        ids, pos = torch.tensor([7], device=device), torch.tensor([args.prompt_len], device=device)
        with torch.profiler.profile(record_shapes=True, with_stack=True) as prof:
            model.forward_static(ids, pos, 256, kv)
    finally:
        runtime.close()
    counts: Counter = Counter()
    for event in prof.events():
        if event.name in ("aten::copy_", "aten::_to_copy", "aten::contiguous", "aten::clone", "aten::cat"):
            frame = next((f for f in event.stack if "/engine/" in f), "?")
            counts[(event.name, frame.split("/engine/")[-1], str(event.input_shapes)[:70])] += 1
    print("\n".join(f"{n:4d}  {name:16} {frame:45} {shapes}" for (name, frame, shapes), n in counts.most_common(40)))


def _device_us(event) -> float:
    """An averaged profiler event's own device time in microseconds, across torch versions."""
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)


def _device_name(device: str) -> str:
    return torch.cuda.get_device_name() if device == "cuda" else device


def table(paths: list[str]) -> None:
    print(f"{'row':28} {'ms/token':>9} {'p90':>7} {'TTFT ms':>8} {'hit rate':>8} {'PCIe GB/tok':>11} "
          f"{'wait ms/tok':>11} {'prompts':>7}")
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            x = r["extra"]
            print(f"{r['name']:28} {r['tpot_median_s'] * 1e3:9.2f} {r['tpot_p90_s'] * 1e3:7.2f} "
                  f"{r['ttft_median_s'] * 1e3:8.1f} {x.get('hit_rate', float('nan')):8.3f} "
                  f"{x.get('pcie_gb_per_token', float('nan')):11.4f} "
                  f"{x.get('pcie_wait_s_per_token', float('nan')) * 1e3:11.3f} {x.get('prompts_timed', 0):7}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["rows", "profile", "ops", "table"])
    parser.add_argument("paths", nargs="*", help="table: result files")
    parser.add_argument("--label", default="ours")
    parser.add_argument("--rows", default="none", help="comma-separated prefetch modes, +cpu for --cpu-experts auto, +eager for no CUDA graphs")
    parser.add_argument("--checkpoint", default="/tmp/olmoe_shape")
    parser.add_argument("--device", default="cuda", help="cpu: smoke-test the script on a small checkpoint")
    parser.add_argument("--budget", default="3GiB")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60, help="per row: time no further prompt after this")
    parser.add_argument("--out")
    args = parser.parse_args()
    print(f"engine from {engine.__file__}", flush=True)
    {"rows": rows, "profile": profile, "ops": ops, "table": lambda a: table(a.paths)}[args.mode](args)


if __name__ == "__main__":
    main()
