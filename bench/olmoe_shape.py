"""OLMoE-1B-7B-shaped checkpoint with random weights: transformers vs accelerate vs ours.

One device call:
    python bench/olmoe_shape.py --out $OUT/olmoe_shape.json
Rows: transformers eager all-GPU, ours all-GPU, accelerate dispatch at a 3 GiB GPU budget,
ours at the same budget. Random weights have no routing locality, so hit rates here are a
worst case; the real-routing numbers come from the trained default model.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.rows import guarded, seeded_prompts, time_engine_decode, time_hf_decode  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402

OLMOE_SHAPE = dict(vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                   num_attention_heads=16, num_key_value_heads=16, num_experts=64, num_experts_per_tok=8,
                   max_position_embeddings=4096, tie_word_embeddings=False)


def build_checkpoint(path: Path, shape: dict) -> None:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    if (path / "config.json").exists():
        return
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = OlmoeForCausalLM(OlmoeConfig(**shape)).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    free_gpu()


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def transformers_row(path: Path, prompts, tokens: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    try:
        return time_hf_decode("transformers eager all-GPU", model, prompts, tokens, torch.device("cuda"))
    finally:
        del model
        free_gpu()


def accelerate_row(path: Path, budget: str, prompts, tokens: int):
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
    device_map = infer_auto_device_map(empty, max_memory={0: budget, "cpu": "200GiB"},
                                       no_split_module_classes=["OlmoeDecoderLayer"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map=device_map).eval()
    try:
        return time_hf_decode(f"accelerate offload {budget}", model, prompts, tokens, torch.device("cuda"))
    finally:
        del model
        free_gpu()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--checkpoint", default="/tmp/olmoe_shape")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--accelerate-tokens", type=int, default=6)
    parser.add_argument("--accelerate-prompts", type=int, default=2)
    parser.add_argument("--budget", default="3GiB")
    args = parser.parse_args()

    path = Path(args.checkpoint)
    started = time.perf_counter()
    build_checkpoint(path, OLMOE_SHAPE)
    print(f"checkpoint ready in {time.perf_counter() - started:.0f}s", flush=True)
    prompts = seeded_prompts(OLMOE_SHAPE["vocab_size"], args.prompts, args.prompt_len)
    ours = EngineConfig(model=str(path), device="cuda", max_model_len=1024)
    offloaded = replace(ours, gpu_expert_budget=args.budget)
    names = {"hf": "transformers eager all-GPU", "gpu": "ours all-GPU", "off": f"ours offloaded {args.budget} LRU",
             "acc": f"accelerate offload {args.budget}"}
    rows: list = []
    guarded(rows, names["hf"], lambda: transformers_row(path, prompts, args.tokens))
    guarded(rows, names["gpu"], lambda: time_engine_decode(names["gpu"], ours, prompts, args.tokens))
    free_gpu()
    guarded(rows, names["off"], lambda: time_engine_decode(names["off"], offloaded, prompts, args.tokens))
    free_gpu()
    guarded(rows, names["acc"], lambda: accelerate_row(path, args.budget, prompts[: args.accelerate_prompts],
                                                       args.accelerate_tokens))
    tpot = {r.name: r.tpot_median_s for r in rows}
    ratios = {"ours_gpu_vs_transformers": tpot[names["hf"]] / tpot[names["gpu"]],
              "ours_offloaded_vs_accelerate": tpot[names["acc"]] / tpot[names["off"]]}
    result = {"command": " ".join(sys.argv), "shape": OLMOE_SHAPE, "device": torch.cuda.get_device_name(),
              "rows": [r.as_dict() for r in rows], "ratios": ratios}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
