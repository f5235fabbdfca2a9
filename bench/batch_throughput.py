"""Engine-level batched decode: aggregate tok/s at several concurrencies, no HTTP (issue G's table 0 and 2).

    python bench/batch_throughput.py --table default --batches 1 8 32 64 --out $OUT/batch
    python bench/batch_throughput.py --table mixtral-gpu --batches 1 8 32 64 --out $OUT/batch
    python bench/batch_throughput.py --table mixtral --budget 25% --batches 1 4 16 32 --out $OUT/batch
    python bench/batch_throughput.py --table mixtral --budget 25% --spec draft --batches 1 4 16 32 --out $OUT/batch
    python bench/batch_throughput.py --table mixtral --budget 25% --expert-quant int4 --batches 1 --out $OUT/quant
    python bench/batch_throughput.py --table default --device cpu --batches 1 4 --tokens 8 --out /tmp/batch

Each row sends B greedy requests (held-out prompts of --prompt-len tokens, EOS ignored so every
one generates --tokens) to one EngineCore at once, as llama-batched-bench does, after an untimed
warm-up of the same shape (graphs captured). Decode throughput is B x (tokens - 1) over the
time from the step in which the last sequence got its first token to the end. The engine's own
counters over that window give expert bytes copied per generated token and the hit rate; the
floor of a step is max(HBM bytes it must read, bytes it copied over PCIe) over the bandwidths
measured in the same run, with the experts read per step taken from the cache's own count of
the distinct experts each layer run used. All on the GPU no cache counts them: a replayed step
counts T*k (token, expert) pairs per layer, capped at the layer's expert count, so between bs=1
and saturation those rows' floor is an upper bound (the kernel reads each distinct expert once).

The first row also times the single-sequence path the engine used before batching
(PlainDecoder over a BoundModel, CUDA-graphed) on the same prompt: bs=1 must not get slower.
--bs1-rounds N then alternates the two, N rounds of one run each, and reports the median of the
rounds' ratios (a host-bound step drifts more between two long runs than the 5% asked).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.checkpoints import expanded_default  # noqa: E402
from bench.floor import floor_seconds, measure_bandwidths, step_bytes  # noqa: E402
from bench.prompts import heldout_prompts  # noqa: E402
from bench.rows import seeded_prompts  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.core import EngineCore  # noqa: E402
from moe_serve.engine.decode import PlainDecoder  # noqa: E402
from moe_serve.engine.messages import GenerateRequest, SamplingParams  # noqa: E402
from moe_serve.engine.sequence import Sequence  # noqa: E402

DEFAULT_MODEL = REPO / "moe_serve" / "models" / "default"


def batch_decode(core: EngineCore, prompts: list[list[int]], tokens: int, tag: str) -> dict:
    """All prompts at once, greedy, EOS ignored; the decode window starts when the last one has its first token."""
    for i, prompt in enumerate(prompts):
        core.add_request(GenerateRequest(f"{tag}-{i}", tuple(prompt), SamplingParams(max_tokens=tokens, temperature=0)))
    started = time.perf_counter()
    produced: dict[str, list[int]] = {}
    window_start = None
    steps = 0
    while core.has_unfinished():
        for out in core.step():
            if out.error:
                raise RuntimeError(out.error)
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        if window_start is None and len(produced) == len(prompts):
            window_start = time.perf_counter()
            core.runtime.reset_stats()
            steps = 0
        steps += 1
    ended = time.perf_counter()
    decoded = sum(len(t) for t in produced.values()) - len(prompts)
    stats = core.runtime.generation_stats(ttft_seconds=None, tpot_seconds=None)
    return {"prefill_s": window_start - started, "decode_s": ended - window_start, "decoded": decoded,
            "decode_steps": steps, "tokens": {k: v for k, v in sorted(produced.items())}, "stats": stats}


def single_sequence_tpot(core: EngineCore, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """TPOT of the pre-batching path: one sequence through PlainDecoder over the runtime's BoundModel
    (the second of two runs: the first captures its graphs)."""
    for _ in range(2):
        decoder = PlainDecoder(core.runtime.target)
        decoder.reset()
        seq = Sequence("single", list(prompt), SamplingParams(max_tokens=tokens, temperature=0), seed=0)
        decoder.step(seq, core.runtime.max_model_len)  # the prefill
        sync(core)
        first = time.perf_counter()
        while not seq.is_finished:
            decoder.step(seq, core.runtime.max_model_len)
            core.runtime.finish_step()
        sync(core)
    return (time.perf_counter() - first) / (len(seq.output_ids) - 1), seq.output_ids


def sync(core: EngineCore) -> None:
    if core.runtime.target.device.type == "cuda":
        torch.cuda.synchronize()


def row(config: EngineConfig, prompts: list[list[int]], batch: int, tokens: int, model_dir: Path,
        dtype: torch.dtype, bw, single: bool, bs1_rounds: int = 0) -> dict:
    core = EngineCore(replace(config, max_num_seqs=max(batch, 1)))
    try:
        batch_decode(core, prompts[:batch], tokens, "warm-up")
        run = batch_decode(core, prompts[:batch], tokens, "timed")
        result = {"batch": batch, "decode_tok_per_s": run["decoded"] / run["decode_s"],
                  "step_ms": 1e3 * run["decode_s"] / max(1, run["decode_steps"]),
                  "prefill_s": run["prefill_s"], "settings": core.runtime.describe()}
        stats, decoded, steps = run["stats"], run["decoded"], max(1, run["decode_steps"])
        accesses = stats["expert_hits"] + stats["expert_misses"]
        result |= {"hit_rate": stats["hit_rate"], "pcie_gb_per_token": stats["pcie_bytes"] / 1e9 / decoded,
                   "pcie_wait_ms_per_step": 1e3 * stats["pcie_wait_seconds"] / steps,
                   "spec": {k: stats[k] for k in ("verify_steps", "acceptance_rate", "mean_accepted_length")
                            if k in stats}}
        sb = step_bytes(model_dir, dtype, context_tokens=len(prompts[0]) + tokens / 2, expert_quant=config.expert_quant)
        # HBM per step: non-expert weights once, the distinct experts the layer runs used (all-GPU graph
        # replays count T*k per layer, so capped at every expert of the model), each sequence's KV
        hbm = sb.non_expert + min(sb.expert_bytes * accesses / steps, sb.all_experts) + sb.kv * batch
        pcie = stats["pcie_bytes"] / steps
        floor = max(hbm / bw.hbm_bytes_per_s, pcie / bw.h2d_bytes_per_s)
        result |= {"floor_step_ms": 1e3 * floor, "measured_over_floor": run["decode_s"] / steps / floor,
                   "floor_bound": "pcie" if pcie / bw.h2d_bytes_per_s > hbm / bw.hbm_bytes_per_s else "hbm",
                   "bs1_floor": floor_seconds(sb, stats["pcie_bytes"] / decoded, bw) if batch == 1 else None}
        if single:
            tpot, single_tokens = single_sequence_tpot(core, prompts[0], tokens)
            result["single_sequence_tpot_ms"] = 1e3 * tpot
            result["batched_bs1_tpot_ms"] = 1e3 * run["decode_s"] / steps
            result["single_sequence_same_tokens"] = single_tokens == run["tokens"]["timed-0"]
            # a host-bound step drifts between two long runs by more than 5%: alternate the two
            # paths in short rounds and compare each round's pair
            rounds = []
            for r in range(bs1_rounds):
                again = batch_decode(core, prompts[:1], tokens, f"bs1-{r}")
                rounds.append((1e3 * again["decode_s"] / max(1, again["decode_steps"]),
                               1e3 * single_sequence_tpot(core, prompts[0], tokens)[0]))
            if rounds:
                result["bs1_rounds_tpot_ms"] = rounds  # (batched, single-sequence) per round
                result["bs1_batched_over_single_median"] = statistics.median(b / s for b, s in rounds)
        result["first_tokens"] = run["tokens"]["timed-0"][:16]
        return result
    finally:
        core.close()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", choices=["default", "mixtral-gpu", "mixtral"], default="default")
    parser.add_argument("--budget", default=None, help="--gpu-expert-budget for the offloaded table")
    parser.add_argument("--policy", default="lru")
    parser.add_argument("--cpu-experts", default="off", choices=["off", "auto"])
    parser.add_argument("--spec", default="off", choices=["off", "self", "draft"],
                        help="--spec of the engine: alone or as a batch, where measured to pay (draft: the default model's dense draft)")
    parser.add_argument("--spec-tokens", type=int, default=12)
    parser.add_argument("--expert-quant", default="none", help="the experts' format (moe-serve's --expert-quant)")
    parser.add_argument("--name", default=None, help="result file stem (default: batch-TABLE[-BUDGET])")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--expert-mb", type=float, default=352.0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--bs1-rounds", type=int, default=0,
                        help="bs=1 first: then this many rounds alternating the batched and single-sequence paths")
    parser.add_argument("--work", default=str(REPO / ".out" / "bench-models"))
    parser.add_argument("--out", required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = DEFAULT_MODEL
    if args.table != "default":
        model_dir = Path(expanded_default(DEFAULT_MODEL, Path(args.work) / f"default-{args.expert_mb:g}mb",
                                          args.expert_mb)["dst"])
    budget = args.budget if args.table == "mixtral" else None
    config = EngineConfig(model=str(model_dir), device=str(device), gpu_expert_budget=budget, cache_policy=args.policy,
                          cpu_experts=args.cpu_experts, spec=args.spec, spec_tokens=args.spec_tokens,
                          expert_quant=args.expert_quant,
                          draft=str(REPO / "moe_serve" / "models" / "default-draft") if args.spec == "draft" else None,
                          max_model_len=args.prompt_len + args.tokens + 16)
    try:
        prompts = heldout_prompts(DEFAULT_MODEL, max(args.batches), args.prompt_len)
        source = "held-out stdlib files"
    except FileNotFoundError:
        prompts = seeded_prompts(8192, max(args.batches), args.prompt_len)
        source = "random token ids (corpus missing)"
    expert_bytes = step_bytes(model_dir, dtype, 0, args.expert_quant).expert_bytes or 2**20
    bw = measure_bandwidths(device, h2d_bytes=max(expert_bytes, 2**20))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = args.name or (f"batch-{args.table}" + (f"-{budget.rstrip('%')}" if budget else "")
                         + ("" if args.expert_quant == "none" else f"-quant-{args.expert_quant}"))
    report = {"command": "python bench/batch_throughput.py " + " ".join(argv or sys.argv[1:]),
              "table": args.table, "model": str(model_dir), "budget": budget, "policy": args.policy,
              "cpu_experts": args.cpu_experts, "spec": args.spec, "spec_tokens": args.spec_tokens,
              "expert_quant": args.expert_quant,
              "prompts": f"{args.prompt_len} tokens of {source}", "tokens": args.tokens, "dtype": str(dtype),
              "bandwidths": bw.as_dict(), "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "rows": []}
    for i, batch in enumerate(args.batches):
        try:
            result = row(config, prompts, batch, args.tokens, model_dir, dtype, bw, single=i == 0,
                         bs1_rounds=args.bs1_rounds if batch == 1 else 0)
        except Exception as exc:  # noqa: BLE001 - a failed row is reported, the others still run
            result = {"batch": batch, "error": f"{type(exc).__name__}: {exc}"}
        report["rows"].append(result)
        print(json.dumps({k: v for k, v in result.items() if k not in ("settings", "first_tokens")}), flush=True)
        (out / f"{name}.json").write_text(json.dumps(report, indent=1))
    base = report["rows"][0].get("decode_tok_per_s")
    for r in report["rows"]:
        if base and "decode_tok_per_s" in r:
            r["speedup_vs_first"] = r["decode_tok_per_s"] / base
    (out / f"{name}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
