"""Routing-trace replay numbers: record the default model's routing on held-out text (CPU), replay it.

    python bench/routing_replay.py --out bench/results/routing-replay
    python bench/routing_replay.py --model /tmp/smoke/default --prompts 2 --tokens 8 --out /tmp/replay

Greedy-decodes held-out stdlib prompts through the engine with a RoutingRecorder on the expert
runner (moe_serve/engine/trace.py), then replays the trace through the cache's own ExpertSlotTable and policies
(moe_serve/engine/replay.py): LRU, LFU and MRS, with and without the next-layer predictor, at 2, 4 and 6
expert slots per MoE layer. Writes routing_replay.json and routing_replay.md.

A second table asks what speculative decoding can save in expert copies at all: the decode
steps merged n at a time into one layer run (a verify pass of n tokens, all n - 1 drafts
accepted: its best case), replayed under each policy. Expert loads per generated token below plain
decoding's (n = 1) are the only way a verify pass saves PCIe bytes.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.prompts import heldout_prompts  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.decode import BoundModel, PlainDecoder  # noqa: E402
from moe_serve.engine.experts.runner import CachedExpertRunner  # noqa: E402
from moe_serve.engine.kv_cache import KVCache  # noqa: E402
from moe_serve.engine.loader import load_model, read_config  # noqa: E402
from moe_serve.engine.messages import GenerateRequest, SamplingParams  # noqa: E402
from moe_serve.engine.replay import PREDICTORS, REPLAY_POLICIES, Result, load_trace, replay  # noqa: E402
from moe_serve.engine.sequence import Sequence  # noqa: E402
from moe_serve.engine.trace import RoutingRecorder  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def record(model_dir: str, prompts: list[list[int]], tokens: int, trace: Path) -> None:
    """Greedy decode of every prompt with the recorder on; the cache keeps its state across prompts,
    as a server's does. (build_runtime does not wire EngineConfig.record_routing, so the pieces are
    assembled here the way it assembles them, plus the recorder.)"""
    config = EngineConfig(model=model_dir, device="cpu")
    device, max_len = torch.device("cpu"), len(prompts[0]) + tokens + 1
    with RoutingRecorder(trace, read_config(model_dir).top_k) as recorder:
        runners: list[CachedExpertRunner] = []

        def observed_runner(store, model_config) -> CachedExpertRunner:
            runners.append(CachedExpertRunner.from_config(store, config, top_k=model_config.top_k, observer=recorder))
            return runners[-1]

        loaded = load_model(model_dir, device, runner_factory=observed_runner, progress=False)
        runners[0].set_router_weights(loaded.model.router_weights())
        kv = KVCache.for_model(loaded.config, max_len, device=device, dtype=torch.float32)
        decoder = PlainDecoder(BoundModel(loaded.model, kv, device, on_forward=recorder.begin_forward))
        for i, prompt in enumerate(prompts):
            decoder.reset()
            seq = Sequence.from_request(GenerateRequest(f"trace-{i}", tuple(prompt),
                                                        SamplingParams(max_tokens=tokens, temperature=0.0)))
            while seq.finish_reason is None:
                decoder.step(seq, max_len)
                runners[0].finish_step()


def as_row(r: Result, num_layers: int) -> dict:
    t = r.total
    return {"policy": r.policy, "predictor": r.predictor, "slots_per_layer": r.capacity // num_layers,
            "capacity": r.capacity, "hit_rate": t.hit_rate, "hits": t.hits, "misses": t.misses,
            "prefetched": t.prefetch_bytes, "prefetch_used": t.prefetch_used, "prefetch_wasted": t.prefetch_wasted,
            "predictor_accuracy": t.predictor_accuracy if r.predictor != "none" else None}


def verify_rows(trace_path: Path, pass_sizes: list[int], slots_per_layer: list[int]) -> list[dict]:
    """Per verify-pass size n, cache size and policy: distinct experts per layer run, loads per token."""
    rows = []
    for n in sorted({1, *pass_sizes}):  # n = 1, plain decoding, is what the others are compared with
        trace = load_trace(trace_path, verify_tokens=n)
        for result in replay(trace, [s * trace.num_layers for s in slots_per_layer], REPLAY_POLICIES, ["none"]):
            rows.append({"tokens_per_pass": n, "slots_per_layer": result.capacity // trace.num_layers,
                         "policy": result.policy,
                         "experts_per_layer_run": sum(len(r.experts) for r in trace.runs) / len(trace.runs),
                         "loads_per_token": result.total.misses / trace.tokens, "hit_rate": result.total.hit_rate})
    return rows


def markdown(result: dict) -> str:
    lines = [f"# {result['title']}", "", f"Command: `{result['command']}`", ""]
    lines += [f"- {note}" for note in result["notes"]] + [""]
    lines += ["| slots/layer | policy | predictor | hit rate | misses | prefetched | used | wasted | predictor accuracy |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        acc = "–" if r["predictor_accuracy"] is None else f"{r['predictor_accuracy']:.1%}"
        lines.append(f"| {r['slots_per_layer']} | {r['policy']} | {r['predictor']} | {r['hit_rate']:.1%} | {r['misses']} "
                     f"| {r['prefetched']} | {r['prefetch_used']} | {r['prefetch_wasted']} | {acc} |")
    lines += ["", "## Verify passes: expert loads per generated token (decode steps only, no prefetch)", "",
              "n tokens per verify pass = n - 1 accepted drafts + the bonus token (n = 1: plain decoding); "
              "'vs plain LRU' < 1 is the only room speculative decoding has to save PCIe bytes.", "",
              "| tokens per pass | slots/layer | policy | experts per layer run | hit rate | loads per token "
              "| vs plain LRU |", "|---|---|---|---|---|---|---|"]
    plain = {r["slots_per_layer"]: r["loads_per_token"] for r in result["verify_rows"]
             if r["tokens_per_pass"] == 1 and r["policy"] == "lru"}
    for r in sorted(result["verify_rows"], key=lambda r: (r["slots_per_layer"], r["tokens_per_pass"], r["policy"])):
        lines.append(f"| {r['tokens_per_pass']} | {r['slots_per_layer']} | {r['policy']} "
                     f"| {r['experts_per_layer_run']:.2f} | {r['hit_rate']:.1%} | {r['loads_per_token']:.3f} "
                     f"| {r['loads_per_token'] / plain[r['slots_per_layer']]:.2f}x |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO / "moe_serve" / "models" / "default"))
    parser.add_argument("--out", required=True)
    parser.add_argument("--trace", default="/tmp/default_routing.jsonl", help="where the JSONL trace goes")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-offset", type=int, default=0,
                        help="skip this many held-out files first (a second trace to check choices made on the first)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--slots-per-layer", type=lambda s: [int(v) for v in s.split(",")], default=[2, 4, 6])
    parser.add_argument("--verify-tokens", type=lambda s: [int(v) for v in s.split(",")], default=[2, 3, 5, 9, 13, 17],
                        help="verify pass sizes of the second table (gamma + 1; gamma = 4, 8, 12, 16 among them)")
    parser.add_argument("--no-record", action="store_true", help="replay an existing --trace")
    args = parser.parse_args(argv)
    if not args.no_record:
        prompts = heldout_prompts(args.model, args.prompt_offset + args.prompts, args.prompt_len)[args.prompt_offset:]
        record(args.model, prompts, args.tokens, Path(args.trace))
    trace = load_trace(args.trace)
    results = replay(trace, [s * trace.num_layers for s in args.slots_per_layer], REPLAY_POLICIES, PREDICTORS)
    config = read_config(args.model)
    result = {
        "title": f"Routing-trace replay: default model, {args.prompts} held-out prompts x {args.tokens} tokens"
                 + (f" (held-out files {args.prompt_offset + 1}-{args.prompt_offset + args.prompts})" if args.prompt_offset else ""),
        "command": "python " + " ".join(sys.argv),
        "notes": [f"{trace.num_layers} MoE layers x {trace.num_experts} experts, top-{config.top_k}; "
                  f"{len(trace.runs)} layer runs (prefills and decode steps)",
                  "prompts: {} tokens a third into held-out stdlib files; greedy; the cache state carries over "
                  "between prompts".format(args.prompt_len),
                  "replay counts prefills too; a prefetch lands at once (moe_serve/engine/replay.py), so predictor rows are an "
                  "upper bound for the live prefetcher"],
        "rows": [as_row(r, trace.num_layers) for r in results],
        "verify_rows": verify_rows(Path(args.trace), args.verify_tokens, args.slots_per_layer)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing_replay.json").write_text(json.dumps(result, indent=1))
    (out / "routing_replay.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
