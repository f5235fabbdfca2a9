"""Scratch: where does SP-MoE's extra draft time go? (not committed)"""
import argparse, sys, time, json
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, ".")
import torch
from bench import suite
from bench.rows import engine_generate
from engine.config import EngineConfig
from engine.core import EngineCore
import engine.decode as decode

budget = sys.argv[1] if len(sys.argv) > 1 else "75%"
args = argparse.Namespace(smoke=False, default_model="models/default", work_dir="/tmp/bench_models", prompts=4, prompt_len=64, draft="models/default-draft")
setup = suite.default_setup(args, "default-olmoe", [budget])
base = EngineConfig(model=str(setup.target), device="cuda", max_model_len=1024, draft=str(setup.draft), spec="draft", spec_tokens=8, gpu_expert_budget=budget, cache_policy="next-use")
acc = defaultdict(float)
cnt = defaultdict(int)

def timed(name, fn):
    def call(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[name] += time.perf_counter() - t
            cnt[name] += 1
    return call

orig_result = decode.PendingLogits.result
def result(self):
    t = time.perf_counter(); r = orig_result(self); acc["result_wait"] += time.perf_counter() - t; cnt["result_wait"] += 1; return r
decode.PendingLogits.result = result

out = {}
for name, cutoff in (("plain", 0), ("sp3", 3), ("sp6", 6)):
    core = EngineCore(replace(base, spec_cutoff=cutoff))
    dec = core.runtime.decoder
    dec.drafter.launch = timed("launch", dec.drafter.launch)
    dec._draft = timed("draft_phase", dec._draft)
    dec._verify = timed("verify_phase", dec._verify)
    dec._accept = timed("accept", dec._accept)
    if dec.predictor is not None:
        dec.predictor.predictions = timed("predictions", dec.predictor.predictions)
        dec.predictor.prefetch = timed("handover", dec.predictor.prefetch)
        cache = core.runtime.runner.cache
        cache.prefetch = timed("cache_prefetch", cache.prefetch)
    engine_generate(core, "warm", setup.prompts[0], 128)
    acc.clear(); cnt.clear()
    t0 = time.perf_counter(); toks = 0
    for i, p in enumerate(setup.prompts):
        g = engine_generate(core, f"p{i}", p, 128); toks += g.decoded
    wall = time.perf_counter() - t0
    # GPU-only time of one draft forward: replay 200 times back to back
    drafter = dec.drafter
    L = drafter.kv.length
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(200):
        drafter.model.graphs.forward([5], None, drafter.forward_kwargs.get("on_attention_output")); drafter.kv.length = L
    torch.cuda.synchronize(); gpu_fwd = (time.perf_counter() - t) / 200
    out[name] = {"tokens": toks, "wall_ms_per_tok": wall / toks * 1e3, "replay_ms_back_to_back": gpu_fwd * 1e3,
                 **{k: {"ms_total_per_tok": acc[k] / toks * 1e3, "us_per_call": acc[k] / max(cnt[k], 1) * 1e6, "calls": cnt[k]} for k in acc}}
    core.close()
    print(name, json.dumps(out[name], indent=1), flush=True)
json.dump(out, open(sys.argv[2], "w"), indent=1)
