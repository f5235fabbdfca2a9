"""SP-MoE's cutoff layer, swept: TPOT of `--spec draft` for spec_cutoff = 0..num_moe_layers and automatic.

    python bench/cutoff_sweep.py --out $OUT                      # default model, 352 MB experts, 25% budget
    python bench/cutoff_sweep.py --device cpu --smoke --prompts 2 --tokens 8 --out /tmp/sweep

SP-MoE (Fig. 14) finds TPOT U-shaped in the cutoff: too few prefetched layers leave misses to
the verify pass, too many push copies past the draft phase and evict experts the verify needs.
The sweep says whether this model shows that, and whether the automatic choice (profiled at
start-up, moe_serve/engine/speculative/cutoff.py) is within 10% of the best. Writes cutoff_sweep.json/.md/.png.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import suite  # noqa: E402
from bench.baselines import free_device  # noqa: E402
from bench.floor import measure_bandwidths, step_bytes  # noqa: E402
from bench.report import write_outputs  # noqa: E402
from bench.rows import RowResult, failed_row, guarded, time_engine_decode  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.loader import read_config, resolve_dtype  # noqa: E402

class ChosenCutoff(logging.Handler):
    """The cutoff the engine chose at start-up, read from the spec builder's one log line."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.value: int | None = None
        self.profile: dict | None = None  # the start-up t_comp / t_load it was computed from

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("SP-MoE draft: cross-model prefetch"):
            self.value = int(record.args[0])
            self.profile = asdict(record.args[1])


@contextmanager
def chosen_cutoff() -> Iterator[ChosenCutoff]:
    """The SP-MoE cutoff an engine built inside chooses (None if it chose none)."""
    chosen, log = ChosenCutoff(), logging.getLogger("moe_serve.engine.speculative.builder")
    level = log.level
    log.addHandler(chosen)
    log.setLevel(logging.INFO)
    try:
        yield chosen
    finally:
        log.removeHandler(chosen)
        log.setLevel(level)


def verdict(rows: list[RowResult], num_moe_layers: int, auto_cutoff: int | None) -> dict:
    """U-shape: the best fixed cutoff lies strictly inside the measured range and both ends of that
    range are >= 5% slower than it."""
    swept = {int(r.name.split("=")[1]): r.tpot_median_s for r in rows if r.tpot_median_s == r.tpot_median_s}
    auto = swept.get(auto_cutoff)
    if not swept:
        return {}
    best = min(swept, key=swept.get)
    ends = (min(swept), max(swept))  # 0 and num_moe_layers unless a row failed
    return {
        "best_cutoff": best, "best_tpot_s": swept[best], "auto_cutoff": auto_cutoff, "auto_tpot_s": auto,
        "u_shaped": ends[0] < best < ends[1] and min(swept[c] for c in ends) >= 1.05 * swept[best],
        "ends_measured": ends, "complete": ends == (0, num_moe_layers) and len(swept) == num_moe_layers + 1,
        "auto_over_best": auto / swept[best] if auto is not None else None,
        "auto_within_10pct": auto is not None and auto <= 1.10 * swept[best],
        "end_over_best": {c: swept[c] / swept[best] for c in ends},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny experts, for CPU checks")
    parser.add_argument("--table", default="default-mixtral", choices=list(suite.EXPERT_MB))
    parser.add_argument("--work-dir", default="/tmp/bench_models")
    parser.add_argument("--default-model", default=str(suite.REPO / "moe_serve" / "models" / "default"))
    parser.add_argument("--draft", default=str(suite.REPO / "moe_serve" / "models" / "default-draft"))
    parser.add_argument("--budget", default="25%")
    parser.add_argument("--cache-policy", default=EngineConfig.cache_policy)
    parser.add_argument("--spec-tokens", type=int, default=EngineConfig.spec_tokens, help="gamma")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--warmup-tokens", type=int, default=None, help="default --tokens (captures every span length)")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--deadline-s", type=float, default=540.0)
    parser.add_argument("--min-row-s", type=float, default=20.0)
    parser.add_argument("--note", action="append", default=[], help="a line for the table's notes (e.g. the commit)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    deadline = time.perf_counter() + args.deadline_s
    device, dtype = torch.device(args.device), resolve_dtype(args.dtype, args.device)
    setup = suite.default_setup(args, args.table, [args.budget])
    layers = read_config(setup.target).num_moe_layers
    step = step_bytes(setup.target, dtype, context_tokens=args.prompt_len + args.tokens / 2)
    bw = measure_bandwidths(device, h2d_bytes=step.expert_bytes)
    base = EngineConfig(model=str(setup.target), device=device.type, dtype=args.dtype, max_model_len=args.max_model_len,
                        draft=args.draft, spec="draft", gpu_expert_budget=args.budget, cache_policy=args.cache_policy,
                        spec_tokens=args.spec_tokens)
    result = {"title": f"SP-MoE cutoff sweep, {setup.title}, budget {args.budget}, {base.cache_policy}: "
                       f"{len(setup.prompts)} prompts x {args.tokens} tokens",
              "command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name()
              if device.type == "cuda" else "cpu", "versions": suite.versions(),
              "notes": args.note + setup.notes + ["cutoff c: target MoE layers 0..c-1 get cross-model prefetch while drafting",
                                                  "the automatic cutoff is read from one untimed engine, which also warms the process up; "
                                                  "its TPOT is the swept row of the cutoff it chose"],
              "bandwidths": bw.as_dict(), "step_bytes": step.as_dict(), "build": setup.build, "rows": [], "ratios": {}}
    # The automatic choice is a fixed cutoff once made: read it from an untimed engine, which also
    # takes the process's one-time costs. (Timing it as a row of its own measured the same
    # configuration twice: identical rows differed by up to 25%, the spread between runs.)
    with chosen_cutoff() as chosen:
        time_engine_decode("process warm-up", base, setup.prompts[:1], args.warmup_tokens or args.tokens)
    auto_cutoff = chosen.value
    result["auto_profile"] = chosen.profile
    free_device()
    rows: list[RowResult] = []
    for cutoff in range(layers + 1):
        name = f"cutoff={cutoff}"
        config = replace(base, spec_cutoff=cutoff)
        if deadline - time.perf_counter() < args.min_row_s:
            rows.append(failed_row(name, {"skipped": "the call's deadline"}))
        else:
            guarded(rows, name, lambda: time_engine_decode(name, config, setup.prompts, args.tokens,
                                                           warmup_tokens=args.warmup_tokens, deadline=deadline - 10))
        free_device()
        suite.annotate(rows[-1], args.budget, step, bw)
        result["rows"] = [r.as_dict() for r in rows]
        result["ratios"] = verdict(rows, layers, auto_cutoff)
        write_outputs(Path(args.out), "cutoff_sweep", result)
    print((Path(args.out) / "cutoff_sweep.md").read_text())


if __name__ == "__main__":
    main()
