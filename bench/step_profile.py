"""Where an offloaded decode step's time goes: torch.profiler over a few steps, summed per kernel.

    python bench/step_profile.py --budget 33% --expert-quant int4 --out $OUT
    python bench/step_profile.py --budget 25% --expert-quant int4 --batch 32 --steps 4 --out $OUT
    python bench/step_profile.py --device cpu --expert-mb 4 --budget 50% --steps 2 --out /tmp/profile

Builds the engine as bench/batch_throughput.py's `--table mixtral` does (the default model, its
experts widened to --expert-mb), decodes --batch greedy sequences past their warm-up, then profiles
--steps engine steps. Per step: wall time, the host's CUDA runtime calls (count and time, by name),
the union of the GPU's busy intervals (kernels and copies, any stream), host-to-device copy time
and count, and the GPU's idle stretches of 20 us or more between its first and last work (where it
waited on the host: a layer's routing read back, its bookkeeping, the next launch); over all
steps: each kernel's mean time per step, largest first. `gpu_idle_ms` (wall minus busy) is what the host alone costs a step.
--trace also writes the Chrome trace.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.batch_throughput import DEFAULT_MODEL, batch_decode  # noqa: E402
from bench.checkpoints import expanded_default  # noqa: E402
from bench.rows import seeded_prompts  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.core import EngineCore  # noqa: E402
from moe_serve.engine.messages import GenerateRequest, SamplingParams  # noqa: E402

GPU_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
RUNTIME = "cuda_runtime"  # the host's CUDA API calls: launches, copies, event records and syncs
STEP = "engine-step-"
MIN_GAP_US = 20  # idle stretches of the GPU listed per step: from this long


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as disjoint ones, in order."""
    union: list[tuple[float, float]] = []
    for start, stop in sorted(intervals):
        if union and start <= union[-1][1]:
            union[-1] = (union[-1][0], max(union[-1][1], stop))
        else:
            union.append((start, stop))
    return union


def summarize(events: list[dict], walls: list[float]) -> dict:
    """The trace's events grouped by the profiled steps (record_function ranges named STEP + i)."""
    # the host's ranges: each record_function also leaves a "gpu_user_annotation" of the same name
    steps = sorted((e["ts"], e["ts"] + e["dur"]) for e in events
                   if e.get("cat") == "user_annotation" and e.get("name", "").startswith(STEP))
    gpu = [e for e in events if e.get("cat") in GPU_EVENTS and "dur" in e]
    runtime = [e for e in events if e.get("cat") == RUNTIME and "dur" in e]
    per_kernel: dict[str, float] = defaultdict(float)
    rows = []
    for (step_start, step_end), wall in zip(steps, walls):
        inside = [e for e in gpu if step_start <= e["ts"] < step_end]  # launched in the step (may run past its end)
        for e in inside:
            per_kernel[e["name"][:80]] += e["dur"] / len(steps)
        h2d = [e["dur"] for e in inside if e["cat"] == "gpu_memcpy" and "HtoD" in e["name"]]
        union = merged([(e["ts"], e["ts"] + e["dur"]) for e in inside])
        busy = sum(end - begin for begin, end in union)
        # where the GPU waited on the host within the step: [us from the step's start, us idle]
        gaps = [(round(end - step_start), round(following - end)) for (_, end), (following, _) in zip(union, union[1:])
                if following - end >= MIN_GAP_US]
        calls: dict[str, list] = defaultdict(lambda: [0, 0.0])  # name -> [count, us]
        for e in runtime:
            if step_start <= e["ts"] < step_end:
                calls[e["name"]][0] += 1
                calls[e["name"]][1] += e["dur"]
        rows.append({"wall_ms": 1e3 * wall, "gpu_busy_ms": busy / 1e3, "gpu_idle_ms": 1e3 * wall - busy / 1e3,
                     "h2d_ms": sum(h2d) / 1e3, "h2d_copies": len(h2d), "idle_gaps_us": gaps,
                     "runtime_calls": {name: {"count": n, "us": round(us)}
                                       for name, (n, us) in sorted(calls.items(), key=lambda kv: -kv[1][1])}})
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])
    return {"steps": rows, "mean_us_per_step": [{"name": name, "us": us} for name, us in top[:30]]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default="33%", help="--gpu-expert-budget")
    parser.add_argument("--expert-quant", default="none")
    parser.add_argument("--policy", default="lru", help="--cache-policy (batch_throughput.py's default)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--expert-mb", type=float, default=352.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--work", default=str(REPO / ".out" / "bench-models"))
    parser.add_argument("--name", default=None, help="result file stem (default: step-profile-QUANT-BUDGET)")
    parser.add_argument("--trace", action="store_true", help="also write the Chrome trace")
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = expanded_default(DEFAULT_MODEL, Path(args.work) / f"default-{args.expert_mb:g}mb", args.expert_mb)["dst"]
    config = EngineConfig(model=model_dir, device=args.device, gpu_expert_budget=args.budget, cache_policy=args.policy,
                          expert_quant=args.expert_quant, max_model_len=256, max_num_seqs=args.batch)
    cuda = torch.device(args.device).type == "cuda"
    core = EngineCore(config)
    try:
        prompts = seeded_prompts(8192, args.batch, 64)
        batch_decode(core, prompts, 48, "warm-up")  # graphs captured, kernels compiled
        for n, prompt in enumerate(prompts):
            core.add_request(GenerateRequest(f"profiled-{n}", tuple(prompt),
                                             SamplingParams(max_tokens=160, temperature=0)))
        for _ in range(8):  # the prefill and a few decode steps
            core.step()
        walls = []
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for i in range(args.steps):
                started = time.perf_counter()
                with record_function(f"{STEP}{i}"):
                    core.step()
                if cuda:
                    torch.cuda.synchronize()
                walls.append(time.perf_counter() - started)
        settings = core.runtime.describe()
    finally:
        core.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or (f"step-profile-{args.expert_quant}-{args.budget.rstrip('%')}"
                         + (f"-bs{args.batch}" if args.batch > 1 else ""))
    trace = out / f"{name}.trace.json" if args.trace else Path(tempfile.mkdtemp()) / "trace.json"
    prof.export_chrome_trace(str(trace))
    report = {"command": "python bench/step_profile.py " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
              "settings": settings, **summarize(json.loads(trace.read_text())["traceEvents"], walls)}
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    print(json.dumps({"steps": report["steps"][:4], "top": report["mean_us_per_step"][:8]}, indent=1))


if __name__ == "__main__":
    main()
