"""The performance table: peers, our engine all-GPU, and our offloaded stack, against the floor.

One device call per table (bandwidths are measured in the same call as the rows they judge):

    python bench/suite.py --table olmoe-shape     --out $OUT   # random OLMoE-1B-7B: vs transformers, accelerate
    python bench/suite.py --table default-olmoe   --out $OUT   # trained default model, 12.6 MB experts
    python bench/suite.py --table default-mixtral --out $OUT   # trained default model, 352 MB experts
    python bench/suite.py --table default-olmoe --device cpu --smoke --prompts 2 --tokens 8 --out /tmp/suite

Rows (bs=1 greedy, untimed warm-up, median and p90 over prompts): transformers eager all-GPU and
accelerate offload (olmoe-shape only), ours all-GPU, then per expert budget the offloaded stack
on-demand LRU -> + next-layer prefetch -> + MRS, then MRS without next-layer prefetch and on it
CPU compute of missed experts; then the speculative rows under the engine's default policy for
them (next-use): SS-MoE self-draft, an external draft without prefetch, SP-MoE's external draft
with its cross-model (SD-aware) prefetch. The floor of each row is bench/floor.py's. Writes <table>.json/.md/.png under --out after every row.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import checkpoints  # noqa: E402
from bench.baselines import accelerate_row, free_device, transformers_row  # noqa: E402
from bench.floor import Bandwidths, StepBytes, floor_seconds, measure_bandwidths, step_bytes  # noqa: E402
from bench.olmoe_shape import OLMOE_SHAPE  # noqa: E402
from bench.prompts import heldout_prompts  # noqa: E402
from bench.report import write_outputs  # noqa: E402
from bench.rows import RowResult, failed_row, guarded, seeded_prompts, time_engine_decode  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.loader import resolve_dtype  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
EXPERT_MB = {"default-olmoe": 12.6, "default-mixtral": 352.0}  # OLMoE's and Mixtral's bf16 experts
SMOKE_EXPERT_MB = 0.5  # just above the trained 393 KB: the expansion only widens
ALL_GPU = "ours all-GPU"
LRU = "ours offloaded, on-demand LRU"
SPEC_ROWS = ("+ SS-MoE self-draft", "+ external draft, no prefetch (plain SD)", "+ SP-MoE draft, SD-aware prefetch")


@dataclass(frozen=True)
class StackRow:
    name: str
    overrides: dict  # EngineConfig fields on top of the budget


MRS_ALONE = "MRS, no next-layer prefetch"
CPU_EXPERTS = "+ CPU experts (HybriMoE)"

# The first three rows add one thing each to the one above. Next-layer prefetch loses in every
# table so far (README), so the next two start again from MRS without it (its routing-replay
# numbers win at every cache size) and add CPU compute of missed experts. The speculative rows run
# the engine's default policy, next-use, each adding its own
# mechanism: SS-MoE self-draft with its k - r prefetch, an external draft without prefetch
# (SP-MoE's baseline), and SP-MoE's external draft with cross-model (SD-aware) prefetch.
OFFLOAD_STACK = (
    StackRow(LRU, dict(cache_policy="lru")),
    StackRow("+ next-layer prefetch", dict(cache_policy="lru", prefetch="next-layer")),
    StackRow("+ MRS", dict(cache_policy="mrs", prefetch="next-layer")),
    StackRow(MRS_ALONE, dict(cache_policy="mrs")),
    StackRow(CPU_EXPERTS, dict(cache_policy="mrs", cpu_experts="auto")),
    StackRow(SPEC_ROWS[0], dict(cache_policy="next-use", spec="self")),
    StackRow(SPEC_ROWS[1], dict(cache_policy="next-use", spec="draft", spec_cutoff=0)),  # SP-MoE's baseline
    StackRow(SPEC_ROWS[2], dict(cache_policy="next-use", spec="draft")),
)


@dataclass
class Setup:
    """What one table runs on."""
    title: str
    target: Path
    draft: Path | None
    prompts: list[list[int]]
    budgets: list[str]
    baselines: bool  # transformers and accelerate rows
    notes: list[str]
    build: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PlannedRow:
    name: str
    budget: str
    run: Callable[[float], RowResult]  # given the row's deadline


def olmoe_setup(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Setup:
    shape = checkpoints.SMALL_OLMOE_SHAPE if args.smoke else OLMOE_SHAPE
    path = checkpoints.random_olmoe(Path(args.work_dir) / "olmoe_shape", shape, device, dtype)
    prompts = seeded_prompts(shape["vocab_size"], args.prompts, args.prompt_len)
    notes = ["random weights, so random routing: hit rates are a worst case; no SP-MoE row (no draft model)",
             f"accelerate row: {args.accelerate_prompts} prompts x {args.accelerate_tokens} tokens "
             "(it takes ~1.5 s/token; fewer tokens than the other rows)",
             "3GiB is 25% of this shape's 12.9 GB of expert bytes"]
    return Setup("OLMoE-1B-7B shape, random weights", path, None, prompts, args.budgets or ["3GiB"], True,
                 notes, {"shape": shape})


def default_setup(args: argparse.Namespace, table: str, budgets: list[str]) -> Setup:
    expert_mb = SMOKE_EXPERT_MB if args.smoke else EXPERT_MB[table]
    built = checkpoints.expanded_default(Path(args.default_model), Path(args.work_dir) / table, expert_mb)
    target = Path(built["dst"])
    prompts = heldout_prompts(target, args.prompts, args.prompt_len)
    notes = [f"trained default target, experts widened to {expert_mb} MB (same function, real routing); "
             f"prompts: {args.prompt_len} tokens of held-out stdlib files"]
    return Setup(f"default model, {expert_mb} MB experts", target, Path(args.draft), prompts,
                 budgets, False, notes, built)


def plan_rows(setup: Setup, args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> list[PlannedRow]:
    base = EngineConfig(model=str(setup.target), device=device.type, dtype=args.dtype,
                        max_model_len=args.max_model_len, draft=str(setup.draft) if setup.draft else None,
                        spec_tokens=args.spec_tokens)
    tokens, prompts = args.tokens, setup.prompts

    def engine(name: str, config: EngineConfig) -> Callable[[float], RowResult]:
        return lambda deadline: time_engine_decode(name, config, prompts, tokens, warmup_tokens=args.warmup_tokens,
                                                   deadline=deadline)

    rows = []
    if setup.baselines:
        rows.append(PlannedRow("transformers eager all-GPU", "all", lambda d: transformers_row(
            "transformers eager all-GPU", setup.target, prompts, tokens, device, dtype, d)))
        rows.append(PlannedRow("accelerate offload", args.accelerate_budget, lambda d: accelerate_row(
            "accelerate offload", setup.target, args.accelerate_budget, prompts[: args.accelerate_prompts],
            args.accelerate_tokens, dtype, d)))
    rows.append(PlannedRow(ALL_GPU, "all", engine(ALL_GPU, base)))
    for budget in setup.budgets:
        for stack_row in OFFLOAD_STACK:
            config = replace(base, gpu_expert_budget=budget, **stack_row.overrides)
            rows.append(PlannedRow(stack_row.name, budget, engine(stack_row.name, config)))
    return rows


def skip_reason(row: PlannedRow, setup: Setup, device: torch.device) -> str | None:
    if row.name in SPEC_ROWS[1:] and setup.draft is None:
        return "no draft model for this checkpoint"
    if row.name == "accelerate offload" and device.type != "cuda":
        return "accelerate offload needs a GPU"
    return None


def annotate(row: RowResult, budget: str, step: StepBytes, bw: Bandwidths) -> None:
    row.extra["budget"] = budget
    if row.tpot_median_s != row.tpot_median_s:  # NaN: an error or a skip
        return
    floor = floor_seconds(step, row.extra.get("pcie_gb_per_token", 0.0) * 1e9, bw)
    row.extra["floor"] = floor
    row.extra["measured_over_floor"] = row.tpot_median_s / floor["floor_s"]


def ratios(rows: list[RowResult], budgets: list[str], accelerate_budget: str) -> dict:
    """Speed-ups (baseline TPOT / ours) the issue asks for; absent rows give None."""
    tpot = {(r.name, r.extra.get("budget")): r.tpot_median_s for r in rows if r.tpot_median_s == r.tpot_median_s}

    def speedup(baseline: tuple, ours: list[tuple]) -> float | None:
        found = [tpot[k] for k in ours if k in tpot]
        return tpot[baseline] / min(found) if baseline in tpot and found else None

    result = {"ours_all_gpu_vs_transformers": speedup(("transformers eager all-GPU", "all"), [(ALL_GPU, "all")]),
              f"ours_lru_vs_accelerate_at_{accelerate_budget}": speedup(
                  ("accelerate offload", accelerate_budget), [(LRU, accelerate_budget)]),
              f"ours_best_vs_accelerate_at_{accelerate_budget}": speedup(
                  ("accelerate offload", accelerate_budget), [(s.name, accelerate_budget) for s in OFFLOAD_STACK])}
    for budget in budgets:
        result[f"best_spec_vs_lru_at_{budget}"] = speedup((LRU, budget), [(n, budget) for n in SPEC_ROWS])
        result[f"sp_moe_vs_plain_sd_at_{budget}"] = speedup((SPEC_ROWS[1], budget), [(SPEC_ROWS[2], budget)])
    for r in rows:
        if r.extra.get("budget") not in ("all", None) and "measured_over_floor" in r.extra:
            result[f"measured_over_floor: {r.name} [{r.extra['budget']}]"] = r.extra["measured_over_floor"]
    return {k: v for k, v in result.items() if v is not None}


def versions() -> str:
    import transformers

    names = [f"torch {torch.__version__}", f"transformers {transformers.__version__}"]
    try:
        import accelerate
        names.append(f"accelerate {accelerate.__version__}")
    except ImportError:
        names.append("accelerate missing")
    return ", ".join(names)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", required=True, choices=["olmoe-shape", *EXPERT_MB])
    parser.add_argument("--out", required=True, help="directory for <table>.json/.md/.png")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None, help="default: bf16 on cuda, fp32 on cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny OLMoE shape / tiny experts, for CPU checks")
    parser.add_argument("--work-dir", default="/tmp/bench_models", help="where built checkpoints go")
    parser.add_argument("--default-model", default=str(REPO / "moe_serve" / "models" / "default"))
    parser.add_argument("--draft", default=str(REPO / "moe_serve" / "models" / "default-draft"))
    parser.add_argument("--budgets", type=lambda s: s.split(","), default=None,
                        help="expert budgets, e.g. 25%%,50%% (default: 3GiB for olmoe-shape, else 25%%,50%%)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--warmup-tokens", type=int, default=None, help="default --tokens (captures every span length)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--accelerate-budget", default="3GiB")
    parser.add_argument("--accelerate-prompts", type=int, default=2)
    parser.add_argument("--accelerate-tokens", type=int, default=8)
    parser.add_argument("--deadline-s", type=float, default=540.0, help="wall clock for the whole call")
    parser.add_argument("--min-row-s", type=float, default=30.0, help="skip a row with less time than this left")
    parser.add_argument("--spec-tokens", type=int, default=EngineConfig.spec_tokens,
                        help="gamma of the speculative rows (the engine's default unless given)")
    parser.add_argument("--rows", type=lambda s: s.split(","), default=None, help="only rows whose name contains one of these")
    parser.add_argument("--note", action="append", default=[], help="a line for the table's notes (e.g. the commit)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deadline = time.perf_counter() + args.deadline_s
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype, args.device)
    setup = olmoe_setup(args, device, dtype) if args.table == "olmoe-shape" else default_setup(args, args.table, args.budgets or ["25%", "50%"])
    print(f"checkpoint ready after {args.deadline_s - (deadline - time.perf_counter()):.0f} s", flush=True)
    step = step_bytes(setup.target, dtype, context_tokens=args.prompt_len + args.tokens / 2)
    bw = measure_bandwidths(device, h2d_bytes=step.expert_bytes)
    result = {
        "title": f"{setup.title}: bs=1 greedy, {len(setup.prompts)} prompts x {args.tokens} tokens",
        "command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name() if device.type == "cuda"
        else "cpu", "versions": versions(), "notes": args.note + setup.notes + [
            "floor = max(HBM bytes of one decode step / measured d2d bandwidth, the row's PCIe bytes per token "
            "/ measured pinned h2d bandwidth); TPOT and counters cover the decode after the first token",
            "the rows below '+ MRS' start again from MRS without next-layer prefetch (the speculative ones: "
            "from the engine's policy for speculative decoding, next-use); each one after it adds "
            "one mechanism to that row, not to the rows above"],
        "bandwidths": bw.as_dict(), "step_bytes": step.as_dict(), "build": setup.build, "rows": [], "ratios": {}}
    rows: list[RowResult] = []
    planned = [r for r in plan_rows(setup, args, device, dtype) if not args.rows or any(s in r.name for s in args.rows)]
    for row in planned:
        reason = skip_reason(row, setup, device)
        if reason is None and deadline - time.perf_counter() < args.min_row_s:
            reason = "the call's deadline"
        if reason is not None:
            rows.append(failed_row(row.name, {"skipped": reason}))
        else:
            guarded(rows, row.name, lambda: row.run(deadline - 10))
        free_device()
        annotate(rows[-1], row.budget, step, bw)
        result["rows"] = [r.as_dict() for r in rows]
        result["ratios"] = ratios(rows, setup.budgets, args.accelerate_budget)
        write_outputs(Path(args.out), args.table, result)
    print((Path(args.out) / f"{args.table}.md").read_text())


if __name__ == "__main__":
    main()
