"""Replay a routing trace through the expert cache's own ExpertSlotTable and policies (no torch, no GPU).

    python -m moe_serve.engine.replay TRACE --slots-per-layer 2,4,6 --policies lru,lfu,mrs --predictors none,next-layer
    python -m moe_serve.engine.replay TRACE --budget-experts 64,128 --json

Each layer run follows the live CachedExpertRunner: MRS sees the run's scores, the first wave
pins hits and places misses, the next-layer predictor's guess for layer + 1 is prefetched, the
wave is released, further waves follow. One simplification: a prefetch lands at once, where
the live worker copies it while the layer computes.

Besides the live policies the replay knows `opt`, Belady's offline optimum: it evicts the
resident expert whose next use in the trace is furthest away. No server can run it (it reads the
future); it bounds what any eviction policy could reach on the trace.
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import json
import sys
from collections import Counter
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from itertools import groupby
from pathlib import Path

from moe_serve.engine.experts.policies import POLICY_NAMES, EvictionPolicy, Key, LRUPolicy, make_policy
from moe_serve.engine.experts.expert_slots import ExpertSlotTable
from moe_serve.engine.experts.stats import ExpertStats, LayerStats

PREDICTORS = ("none", "next-layer")
REPLAY_POLICIES = (*POLICY_NAMES, "opt")


@dataclass(frozen=True)
class LayerRun:
    layer: int
    experts: list[int]  # distinct experts the run needed, ascending
    scores: dict[int, float]  # MRS's s: per token its top-p probabilities, averaged over tokens
    next_guess: list[int]  # predicted experts of layer + 1, most impact first


@dataclass(frozen=True)
class Trace:
    runs: list[LayerRun]
    num_layers: int
    num_experts: int
    top_p: int  # 2 * top_k: MRS's p and the predictor's per-layer prefetch limit
    tokens: int  # token positions the runs cover


@dataclass(frozen=True)
class Result:
    policy: str
    predictor: str
    capacity: int
    total: LayerStats


def load_trace(path: str | Path, verify_tokens: int | None = None) -> Trace:
    """The trace's layer runs. With verify_tokens n, only the one-token (decode) steps, every n
    consecutive ones merged into one run per layer: what a verify pass over n tokens needs when all
    n - 1 drafts were accepted, the best case of speculative decoding (n = 1: plain decoding)."""
    with open(path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines:
        raise ValueError(f"{path}: empty routing trace")
    if verify_tokens is not None:
        lines = _verify_windows(lines, verify_tokens)
    top_p = len(lines[0]["top_experts"])
    runs = [_layer_run(list(group), top_p) for _, group in groupby(lines, key=lambda d: (d["step"], d["layer"]))]
    num_experts = 1 + max(max(d["top_experts"] + d["experts"] + d.get("next_experts", [])) for d in lines)
    first_layer = min(d["layer"] for d in lines)
    return Trace(runs=runs, num_layers=1 + max(r.layer for r in runs), num_experts=num_experts, top_p=top_p,
                 tokens=sum(d["layer"] == first_layer for d in lines))


def _verify_windows(lines: list[dict], n: int) -> list[dict]:
    """Decode steps renumbered so that each n consecutive ones share a step; prefills dropped (and
    they end a window: a new prompt starts)."""
    first_layer = min(d["layer"] for d in lines)
    tokens = Counter(d["step"] for d in lines if d["layer"] == first_layer)
    window_of: dict[int, int] = {}
    window, in_window = -1, n
    for step in sorted(tokens):
        if tokens[step] != 1:
            in_window = n
            continue
        if in_window == n:
            window, in_window = window + 1, 0
        window_of[step] = window
        in_window += 1
    kept = [dict(d, step=window_of[d["step"]]) for d in lines if d["step"] in window_of]
    return sorted(kept, key=lambda d: (d["step"], d["layer"]))  # stable: token order kept within a run


def _layer_run(tokens: list[dict], top_p: int) -> LayerRun:
    scores: dict[int, float] = {}
    impact: dict[int, float] = {}
    for d in tokens:
        _accumulate(scores, d["top_experts"], d["top_probs"])
        _accumulate(impact, d.get("next_experts", []), d.get("next_probs", []))
    guess = heapq.nlargest(top_p, (e for e in impact if impact[e] > 0), key=impact.__getitem__)
    experts = sorted({e for d in tokens for e in d["experts"]})
    return LayerRun(layer=tokens[0]["layer"], experts=experts,
                    scores={e: s / len(tokens) for e, s in scores.items()}, next_guess=guess)


def _accumulate(into: dict[int, float], experts: Iterable[int], probs: Iterable[float]) -> None:
    for e, p in zip(experts, probs):
        into[e] = into.get(e, 0.0) + p


class OfflineOptimum(LRUPolicy):
    """Belady: evict the candidate whose next use in the trace comes last (never used again: first)."""

    def __init__(self, runs: Sequence[LayerRun]) -> None:
        super().__init__()
        self._position = -1  # index of the run being replayed: the replay begins each run in order
        self._uses: dict[Key, list[int]] = {}  # key -> indices of the runs that need it, ascending
        for i, run in enumerate(runs):
            for e in run.experts:
                self._uses.setdefault((run.layer, e), []).append(i)

    def begin_run(self, layer: int) -> None:
        self._position += 1

    def victims(self, candidates: Collection[Key], n: int) -> list[Key]:
        return heapq.nlargest(n, candidates, key=self._next_use)

    def _next_use(self, key: Key) -> float:
        uses = self._uses.get(key, [])
        i = bisect.bisect_right(uses, self._position)
        return uses[i] if i < len(uses) else float("inf")


def _policy(name: str, trace: Trace) -> EvictionPolicy:
    if name == "opt":
        return OfflineOptimum(trace.runs)
    return make_policy(name, top_k=trace.top_p // 2 or 1, num_layers=trace.num_layers, num_experts=trace.num_experts)


def simulate(trace: Trace, capacity: int, policy: str, predictor: str) -> ExpertStats:
    """Counters (bytes counted in experts) of the live cache on this trace, prefetches landing at once."""
    table = ExpertSlotTable(capacity, _policy(policy, trace))
    stats = ExpertStats(trace.num_layers)
    guesses: dict[int, list[int]] = {}
    for run in trace.runs:
        table.policy.begin_run(run.layer)
        table.policy.observe_scores(run.layer, [run.scores.get(e, 0.0) for e in range(trace.num_experts)])
        if run.layer in guesses:
            hit = len(set(guesses.pop(run.layer)).intersection(run.experts))
            stats.add(run.layer, predicted_correct=hit, predicted_needed=len(run.experts))
        for wave_index, keys in enumerate(_waves(table, stats, run)):
            if wave_index == 0 and predictor == "next-layer" and run.next_guess:
                _prefetch(table, stats, run.layer + 1, run.next_guess)
                guesses[run.layer + 1] = run.next_guess
            for key in keys:
                table.unpin(key)
    return stats


def _waves(table: ExpertSlotTable, stats: ExpertStats, run: LayerRun) -> Iterator[list[Key]]:
    """Plan one wave after another; yields each wave's pinned keys for the caller to release."""
    remaining: list[Key] = [(run.layer, e) for e in run.experts]
    while remaining:
        plan = table.plan_wave(remaining)
        if not plan.hits and not plan.misses.placed:
            raise RuntimeError(f"no expert slot can be freed for layer {run.layer}")
        for key, _ in plan.misses.placed:
            table.complete(key)
        stats.add_wave(run.layer, plan)
        yield plan.hits + [k for k, _ in plan.misses.placed]
        remaining = plan.misses.unplaced


def _prefetch(table: ExpertSlotTable, stats: ExpertStats, layer: int, experts: Sequence[int]) -> None:
    placement = table.place([(layer, e) for e in experts if (layer, e) not in table], pin=False, prefetched=True)
    for key, _ in placement.placed:
        table.complete(key)
    stats.add_prefetch(placement)


def replay(trace: Trace, capacities: Sequence[int], policies: Sequence[str], predictors: Sequence[str]) -> list[Result]:
    return [
        Result(policy, predictor, capacity, simulate(trace, capacity, policy, predictor).snapshot().total())
        for capacity in capacities for policy in policies for predictor in predictors
    ]


def _format_table(results: Sequence[Result]) -> str:
    header = f"{'policy':8} {'predictor':10} {'slots':>6} {'hit rate':>8} {'hits':>8} {'misses':>8} " \
             f"{'evicted':>8} {'prefetch':>8} {'used':>6} {'wasted':>6} {'pred acc':>8}"
    rows = [
        f"{r.policy:8} {r.predictor:10} {r.capacity:>6} {r.total.hit_rate:>8.2%} {r.total.hits:>8} "
        f"{r.total.misses:>8} {r.total.evictions:>8} {r.total.prefetch_bytes:>8} {r.total.prefetch_used:>6} "
        f"{r.total.prefetch_wasted:>6} {r.total.predictor_accuracy:>8.2%}"
        for r in results
    ]
    return "\n".join([header, *rows])


def _as_json(r: Result) -> dict:
    counters = asdict(r.total)
    counters["demand_experts"] = counters.pop("demand_bytes")  # replay counts copies in experts
    counters["prefetch_experts"] = counters.pop("prefetch_bytes")
    return {"policy": r.policy, "predictor": r.predictor, "capacity": r.capacity, "hit_rate": r.total.hit_rate,
            "predictor_accuracy": r.total.predictor_accuracy, **counters}


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _names(choices: Sequence[str]):
    def parse(text: str) -> list[str]:
        names = [v for v in text.split(",") if v]
        unknown = [n for n in names if n not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)}; choose from {', '.join(choices)}")
        return names
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_serve.engine.replay", description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="JSONL written by --record-routing")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--slots-per-layer", type=_int_list, help="cache sizes as expert slots per MoE layer, e.g. 2,4,6")
    size.add_argument("--budget-experts", type=_int_list, help="cache sizes in experts, e.g. 64,128")
    parser.add_argument("--policies", type=_names(REPLAY_POLICIES), default=list(REPLAY_POLICIES),
                        help=f"comma-separated, from {','.join(REPLAY_POLICIES)} (default: all)")
    parser.add_argument("--predictors", type=_names(PREDICTORS), default=list(PREDICTORS),
                        help=f"comma-separated, from {','.join(PREDICTORS)} (default: all)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    trace = load_trace(args.trace)
    capacities = args.budget_experts or [s * trace.num_layers for s in args.slots_per_layer]
    results = replay(trace, capacities, args.policies, args.predictors)
    if args.json:
        json.dump([_as_json(r) for r in results], sys.stdout, indent=1)
        print()
    else:
        print(_format_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
