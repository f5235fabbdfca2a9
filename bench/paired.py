"""Paired A/B timing: several configurations decode the same prompts in alternation.

    python bench/paired.py --table default-olmoe --budget 50% --arm "plain SD" --arm "SP-MoE" --out $OUT
    python bench/paired.py --table default-mixtral --arm "SP-MoE@spec_cutoff=0" --arm "SP-MoE@spec_cutoff=2" --out $OUT
    python bench/paired.py --table default-olmoe --device cpu --smoke --prompts 2 --tokens 8 --out /tmp/paired

Why: bench/suite.py times its rows one after another, and with 12.6 MB experts two rows of the
same configuration differed by up to 25%, more than a prefetch can gain. Here every engine is
built first, then each prompt is decoded by every arm in turn (the order rotates, so no arm is
always first), so drift of the host or the GPU hits all arms alike. Greedy speculative decoding
is lossless: the arms emit the same tokens for a prompt (checked), so the per-prompt ratio of
TPOTs compares the same work. The table gives the median ratio with a bootstrap 95% interval and
a two-sided sign test; an arm is called faster only when the interval lies above 1 and p < 0.05.

An arm is a row name of bench/suite.py's offloaded stack (any unique substring), optionally with
EngineConfig overrides after '@': "SP-MoE@spec_cutoff=2,cache_policy=lru". The first arm is the
baseline every ratio divides by.
"""
from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import suite  # noqa: E402
from bench.cutoff_sweep import chosen_cutoff  # noqa: E402
from bench.floor import measure_bandwidths, step_bytes  # noqa: E402
from bench.report import write_outputs  # noqa: E402
from bench.rows import Generation, RowResult, engine_extra, engine_generate, summary  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.core import EngineCore  # noqa: E402
from moe_serve.engine.loader import resolve_dtype  # noqa: E402

BOOTSTRAP_RESAMPLES = 2000


@dataclass
class Arm:
    name: str
    config: EngineConfig
    runs: list[Generation] = field(default_factory=list)

    def row(self, budget: str) -> RowResult:
        extra = {"budget": budget, **engine_extra([r.stats for r in self.runs], sum(r.decoded for r in self.runs))}
        return summary(self.name, [r.tpot_s for r in self.runs], [r.ttft_s for r in self.runs],
                       sum(r.decoded + 1 for r in self.runs), extra)


def parse_arm(spec: str, base: EngineConfig) -> Arm:
    """'<suite row substring>[@field=value,...]' -> the row's config with the overrides on top."""
    name, _, overrides = spec.partition("@")
    matches = [row for row in suite.OFFLOAD_STACK if name in row.name]
    if len(matches) != 1:
        choices = "; ".join(row.name for row in suite.OFFLOAD_STACK)
        raise SystemExit(f"arm {spec!r}: {name!r} must name exactly one of: {choices}")
    config = replace(base, **matches[0].overrides)
    known = {f.name for f in fields(EngineConfig)}
    for item in filter(None, overrides.split(",")):
        key, _, value = item.partition("=")
        if key not in known:
            raise SystemExit(f"arm {spec!r}: EngineConfig has no field {key!r}")
        config = replace(config, **{key: _value(value)})
    return Arm(spec if overrides else matches[0].name, config)


def _value(text: str) -> bool | int | float | str | None:
    named = {"true": True, "false": False, "none": None}
    if text.lower() in named:
        return named[text.lower()]
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def compare(baseline: list[float], other: list[float], seed: int = 0) -> dict:
    """Speed-up of `other` over `baseline` from paired TPOTs: median of baseline/other per pair,
    its percentile-bootstrap 95% interval, and the sign test of 'other is faster'."""
    ratios = [b / o for b, o in zip(baseline, other, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(BOOTSTRAP_RESAMPLES))
    faster = sum(r > 1 for r in ratios)
    ties = sum(r == 1 for r in ratios)
    return {"speedup_median": statistics.median(ratios),
            "speedup_ci95": [medians[int(0.025 * BOOTSTRAP_RESAMPLES)], medians[int(0.975 * BOOTSTRAP_RESAMPLES) - 1]],
            "faster_pairs": faster, "pairs": len(ratios),
            "sign_test_p": sign_test(faster, len(ratios) - ties)}


def sign_test(successes: int, trials: int) -> float:
    """Two-sided binomial test of p = 1/2."""
    if trials == 0:
        return 1.0
    tail = min(successes, trials - successes)
    p = sum(math.comb(trials, i) for i in range(tail + 1)) / 2 ** trials
    return min(1.0, 2 * p)


def verdict(comparison: dict, alpha: float = 0.05) -> str:
    """'faster' or 'slower' only when the interval excludes 1 and the sign test agrees."""
    low, high = comparison["speedup_ci95"]
    if comparison["sign_test_p"] >= alpha:
        return "tie"
    return "faster" if low > 1 else "slower" if high < 1 else "tie"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stem", default="paired", help="output file names: <stem>.json/.md/.png")
    parser.add_argument("--arm", action="append", required=True, help="two or more; the first is the baseline")
    parser.add_argument("--table", default="default-olmoe", choices=list(suite.EXPERT_MB))
    parser.add_argument("--budget", default="50%")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny experts, for CPU checks")
    parser.add_argument("--work-dir", default="/tmp/bench_models")
    parser.add_argument("--default-model", default=str(suite.REPO / "moe_serve" / "models" / "default"))
    parser.add_argument("--draft", default=str(suite.REPO / "moe_serve" / "models" / "default-draft"))
    parser.add_argument("--spec-tokens", type=int, default=EngineConfig.spec_tokens, help="gamma")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="times each prompt is decoded by every arm")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--warmup-tokens", type=int, default=None,
                        help="default --tokens: the warm-up then captures every span length a timed request ends with")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--deadline-s", type=float, default=540.0, help="stop starting pairs after this")
    parser.add_argument("--note", action="append", default=[])
    args = parser.parse_args(argv)
    if len(args.arm) < 2:
        parser.error("give at least two --arm")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deadline = time.perf_counter() + args.deadline_s
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype, args.device)
    setup = suite.default_setup(args, args.table, [args.budget])
    base = EngineConfig(model=str(setup.target), device=device.type, dtype=args.dtype, max_model_len=args.max_model_len,
                        draft=str(setup.draft), spec_tokens=args.spec_tokens, gpu_expert_budget=args.budget)
    arms = [parse_arm(spec, base) for spec in args.arm]
    step = step_bytes(setup.target, dtype, context_tokens=args.prompt_len + args.tokens / 2)
    bw = measure_bandwidths(device, h2d_bytes=step.expert_bytes)
    result = {"title": f"paired arms, {setup.title}, budget {args.budget}: {len(setup.prompts)} prompts x "
                       f"{args.tokens} tokens x {args.rounds} rounds",
              "command": "python " + " ".join(sys.argv), "versions": suite.versions(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "notes": args.note + setup.notes + [
                  ("every engine is built and warmed up first; then each prompt is decoded by every arm in turn, "
                   "the order rotating by prompt and round"),
                  (f"speed-up of an arm: median over (prompt, round) pairs of TPOT({arms[0].name}) / TPOT(arm), "
                   "with a percentile-bootstrap 95% interval and a two-sided sign test")],
              "bandwidths": bw.as_dict(), "step_bytes": step.as_dict(), "build": setup.build,
              "arms": {arm.name: asdict(arm.config) for arm in arms}, "pairs": [], "rows": [], "ratios": {}}
    cores = []
    try:
        for arm in arms:  # all built before any timing, so every pair sees the same process state
            with chosen_cutoff() as chosen:
                cores.append(EngineCore(arm.config))
            if chosen.value is not None and arm.config.spec_cutoff is None:
                result["notes"].append(f"{arm.name}: automatic cutoff {chosen.value} from the start-up profile "
                                       f"t_comp {chosen.profile['t_comp'] * 1e3:.3f} ms per draft layer, "
                                       f"t_load {chosen.profile['t_load'] * 1e3:.3f} ms per expert")
            engine_generate(cores[-1], "warm-up", setup.prompts[0], args.warmup_tokens or args.tokens)
        for round_ in range(args.rounds):
            for i, prompt in enumerate(setup.prompts):
                if time.perf_counter() > deadline:
                    break
                shift = (round_ + i) % len(arms)
                for j in [*range(shift, len(arms)), *range(shift)]:
                    arms[j].runs.append(engine_generate(cores[j], f"r{round_}-p{i}", prompt, args.tokens))
                    quiesce(device)
                outputs = {arm.runs[-1].tokens for arm in arms}
                result["pairs"].append({"round": round_, "prompt": i, "same_tokens": len(outputs) == 1,
                                        "tpot_s": [arm.runs[-1].tpot_s for arm in arms]})
            if not result["pairs"]:
                raise TimeoutError("the deadline passed before the first pair was timed")
            write_outputs(Path(args.out), args.stem, summarise(result, arms, args.budget, step, bw))
    finally:
        for core in cores:
            core.close()
    print((Path(args.out) / f"{args.stem}.md").read_text())


def quiesce(device: torch.device) -> None:
    """Let an arm's leftover prefetches land before the next arm starts: PCIe is shared."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarise(result: dict, arms: list[Arm], budget: str, step, bw) -> dict:
    rows = [arm.row(budget) for arm in arms]
    for row in rows:
        suite.annotate(row, budget, step, bw)
    result["rows"] = [row.as_dict() for row in rows]
    baseline = [arm_tpots[0] for arm_tpots in (p["tpot_s"] for p in result["pairs"])]
    ratios: dict = {"all_pairs_same_tokens": all(p["same_tokens"] for p in result["pairs"])}
    for j, arm in enumerate(arms[1:], start=1):
        comparison = compare(baseline, [p["tpot_s"][j] for p in result["pairs"]])
        ratios[f"{arm.name} vs {arms[0].name}"] = f"{verdict(comparison)}: " + ", ".join(
            f"{k}={_show(v)}" for k, v in comparison.items())
        result.setdefault("comparisons", {})[arm.name] = comparison
    result["ratios"] = ratios
    return result


def _show(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(f"{v:.3f}" for v in value) + "]"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
