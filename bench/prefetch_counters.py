"""What SP-MoE's draft-phase prefetch does to the expert cache, in counters (CPU, no timing).

    python bench/prefetch_counters.py --policies lru,mrs,next-use --cutoffs 0 \
        --out bench/results/counters/policy_counters.json   # the README's table
    python bench/prefetch_counters.py --out /tmp/prefetch_counters.json   # lru, mrs at cutoffs 0 and 2

Greedy `--spec draft` on the trained default pair over held-out prompts, for each budget, cache
policy and cutoff: misses, prefetched experts used and wasted (evicted unused). These are the
cache's decisions on the real routing, the same on any device; what they cost in time needs the
GPU suite. Counters cover each request's decode (stats reset after the first token), so the
prefill's streamed prefetches used later count as used at every cutoff.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import heldout_prompts  # noqa: E402
from bench.rows import engine_generate  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.core import EngineCore  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def counters(config: EngineConfig, prompts: list[list[int]], tokens: int) -> dict:
    core = EngineCore(config)
    totals = {"expert_hits": 0, "expert_misses": 0, "prefetch_used": 0, "prefetch_wasted": 0}
    try:
        for i, prompt in enumerate(prompts):
            stats = engine_generate(core, f"p{i}", prompt, tokens).stats
            for key in totals:
                totals[key] += stats[key]
    finally:
        core.close()
    return totals


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="JSON file")
    parser.add_argument("--model", default=str(REPO / "moe_serve" / "models" / "default"))
    parser.add_argument("--draft", default=str(REPO / "moe_serve" / "models" / "default-draft"))
    parser.add_argument("--budgets", type=lambda s: s.split(","), default=["25%", "50%"])
    parser.add_argument("--policies", type=lambda s: s.split(","), default=["lru", "mrs"])
    parser.add_argument("--cutoffs", type=lambda s: [int(c) for c in s.split(",")], default=[0, 2])
    parser.add_argument("--spec-tokens", type=int, default=EngineConfig.spec_tokens)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: more threads only spin
    prompts = heldout_prompts(args.model, args.prompts, args.prompt_len)
    rows = []
    for budget in args.budgets:
        for policy in args.policies:
            for cutoff in args.cutoffs:
                config = EngineConfig(model=args.model, device="cpu", spec="draft", draft=args.draft,
                                      gpu_expert_budget=budget, cache_policy=policy, spec_cutoff=cutoff,
                                      spec_tokens=args.spec_tokens)
                rows.append({"budget": budget, "policy": policy, "cutoff": cutoff,
                             **counters(config, prompts, args.tokens)})
                print(rows[-1], flush=True)
    Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
