"""Offloaded decode on the OLMoE-shaped checkpoint: prefetch none / next-layer x --cpu-experts off / auto.

One device call times the engine of this tree and, for the baseline, an older engine tree put
first on PYTHONPATH (this script then imports `engine` from there):
    python bench/offload_overhead.py rows --label after --rows none,none+eager,next-layer,none+cpu --out A.json
    PYTHONPATH=.before python bench/offload_overhead.py rows --label before --rows none,next-layer --out B.json
    python bench/offload_overhead.py profile --out P.json   # host time and the top kernels of one token
    python bench/offload_overhead.py ops --budget 100%      # which aten copies one static forward launches
    python bench/offload_overhead.py table B.json A.json
    python bench/offload_overhead.py prefill --expert-mb 352 --budget 25% --prompt-len 64 --out F.json
The checkpoint is bench/olmoe_shape.py's (random weights, built once on the GPU); with --expert-mb
it is the trained default model widened to experts of that size (bench/checkpoints.py), so 352
is the default-mixtral table's model. `prefill` times TTFT with prefill streaming
(moe_serve/engine/experts/streaming.py) off and on in one engine, against the PCIe floor of each prefill.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parent.parent))  # appended: a PYTHONPATH engine tree wins

import torch

import moe_serve.engine as engine  # before bench.olmoe_shape, which puts this tree first on sys.path
from bench.floor import Bandwidths, measure_bandwidths
from bench.olmoe_shape import OLMOE_SHAPE, build_checkpoint
from bench.rows import guarded, seeded_prompts, time_engine_decode
from moe_serve.engine.config import EngineConfig
from moe_serve.engine.loader import read_config


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
    from moe_serve.engine.core import EngineCore, run_to_completion
    from moe_serve.engine.messages import GenerateRequest, SamplingParams

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

    from moe_serve.engine.runtime import build_runtime

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


def prefill(args: argparse.Namespace) -> None:
    """TTFT of one prefill (max_tokens=1) with streaming off and on, in one engine, each prompt once:
    off and on take turns over distinct prompts, so neither starts from a cache that the same
    prompt just filled. Each prefill's floor is the expert bytes it copied over the pinned
    host->device bandwidth measured in this call; streaming works when its TTFT nears its floor.
    The engine's prefetch mode is the first of --rows (default none: the on-demand LRU row)."""
    from moe_serve.engine.core import EngineCore, run_to_completion
    from moe_serve.engine.messages import GenerateRequest, SamplingParams

    path = _checkpoint(args)
    prompts = seeded_prompts(read_config(str(path)).vocab_size, 2 * args.prompts + 2, args.prompt_len)
    core = EngineCore(replace(_config(args, args.rows.split(",")[0]), model=str(path)))
    runs: dict[bool, list[dict]] = {False: [], True: []}
    try:
        runner = core.runtime.runner
        bandwidths = measure_bandwidths(torch.device(args.device), runner.cache.layout.nbytes, d2d_bytes=2**24)
        for i, prompt in enumerate(prompts):
            runner.stream_prefill = stream = i % 2 == 1
            core.runtime.reset_stats()
            request = GenerateRequest(f"p{i}", tuple(prompt), SamplingParams(max_tokens=1, temperature=0))
            done = run_to_completion(core, request)
            if i >= 2:  # one untimed warm-up prefill per mode
                runs[stream].append(core.runtime.generation_stats(ttft_seconds=done.ttft_seconds, tpot_seconds=None))
        settings = core.runtime.describe()
    finally:
        core.close()
    rows = {f"streaming {'on' if stream else 'off'}": _prefill_row(runs[stream], bandwidths) for stream in (False, True)}
    for name, row in rows.items():
        print(f"{name:14} " + " ".join(f"{k} {v:.4g}" for k, v in row.items()), flush=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "device": _device_name(args.device),
                                          "bandwidths": bandwidths.as_dict(), "settings": settings,
                                          "rows": rows}, indent=2))


def _prefill_row(runs: list[dict], bandwidths: Bandwidths) -> dict:
    """Medians over one mode's prefills; floor_ms: the copied expert bytes at the measured bandwidth."""
    ttft_ms = statistics.median(r["ttft_seconds"] * 1e3 for r in runs)
    floor_ms = statistics.median(r["pcie_bytes"] / bandwidths.h2d_bytes_per_s * 1e3 for r in runs)
    medians = {name: statistics.median(r[key] * scale for r in runs) for name, key, scale in (
        ("pcie_mb", "pcie_bytes", 1e-6), ("pcie_wait_ms", "pcie_wait_seconds", 1e3), ("misses", "expert_misses", 1),
        ("prefetch_used", "prefetch_used", 1), ("prefetch_wasted", "prefetch_wasted", 1))}
    return {"ttft_ms": ttft_ms, "floor_ms": floor_ms, "ttft_over_floor": ttft_ms / floor_ms if floor_ms else float("nan"),
            **medians, "prefills": len(runs)}


def _checkpoint(args: argparse.Namespace) -> Path:
    """The OLMoE-shaped checkpoint, or with --expert-mb the trained default widened to that size."""
    if args.expert_mb is None:
        build_checkpoint(Path(args.checkpoint), OLMOE_SHAPE)
        return Path(args.checkpoint)
    from bench.checkpoints import expanded_default

    root = Path(__file__).resolve().parent.parent
    return Path(expanded_default(root / "moe_serve" / "models" / "default", Path(f"/tmp/default-{args.expert_mb:g}mb"),
                                 args.expert_mb)["dst"])


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
    parser.add_argument("mode", choices=["rows", "profile", "ops", "table", "prefill"])
    parser.add_argument("paths", nargs="*", help="table: result files")
    parser.add_argument("--label", default="ours")
    parser.add_argument("--rows", default="none", help="comma-separated prefetch modes, +cpu for --cpu-experts auto, +eager for no CUDA graphs")
    parser.add_argument("--checkpoint", default="/tmp/olmoe_shape")
    parser.add_argument("--expert-mb", type=float, help="prefill: the trained default model with experts of this size")
    parser.add_argument("--device", default="cuda", help="cpu: smoke-test the script on a small checkpoint")
    parser.add_argument("--budget", default="3GiB")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60, help="per row: time no further prompt after this")
    parser.add_argument("--out")
    args = parser.parse_args()
    print(f"engine from {engine.__file__}", flush=True)
    modes = {"rows": rows, "profile": profile, "ops": ops, "table": lambda a: table(a.paths), "prefill": prefill}
    modes[args.mode](args)


if __name__ == "__main__":
    main()
