"""The checkpoints the benchmark tables run on, built where the benchmark runs (never committed).

  random_olmoe:     the OLMoE-1B-7B shape with random weights, built on the device in the run's
                    dtype and saved with save_pretrained (random routing: a worst case for caches);
  expanded_default: the trained default target with every expert widened to a real expert size by
                    scripts/expand_experts.py (same function, real routing, real byte sizes).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from bench.baselines import free_device

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))
import expand_experts  # noqa: E402  (a script, not a package)

SMALL_OLMOE_SHAPE = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
                         max_position_embeddings=1024, tie_word_embeddings=False, pad_token_id=1,
                         eos_token_id=2)  # CPU smoke runs


def random_olmoe(path: Path, shape: dict, device: torch.device, dtype: torch.dtype) -> Path:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    with torch.device(device):
        model = OlmoeForCausalLM._from_config(OlmoeConfig(**shape), dtype=dtype)
    model.save_pretrained(path, max_shard_size="4GB")
    del model
    free_device()
    return path


def expanded_default(src: Path, dst: Path, expert_mb: float) -> dict:
    """Widen src's experts to expert_mb (bf16 megabytes) into dst, once; returns what was built."""

    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    size = expand_experts.intermediate_for_expert_mb(expert_mb, hidden)
    config = dst / "config.json"
    if config.exists() and json.loads(config.read_text())["moe_intermediate_size"] == size:
        return {"dst": str(dst), "moe_intermediate_size": size, "reused": True}
    return expand_experts.expand(src, dst, size, seed=0, max_shard_bytes=int(4000 * expand_experts.MB))
