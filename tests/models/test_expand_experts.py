"""Widened experts cost more bytes but compute the same function."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import expand_experts  # noqa: E402

TARGET_DIR = REPO / "moe_serve" / "models" / "default"


@pytest.mark.parametrize(("expert_mb", "hidden", "expected"), [(12.6, 2048, 1024), (352, 4096, 14336)])
def test_expert_mb_gives_the_real_models_widths(expert_mb, hidden, expected):
    assert expand_experts.intermediate_for_expert_mb(expert_mb, hidden) == expected


def test_expanded_target_keeps_its_logits(tmp_path):
    old = json.loads((TARGET_DIR / "config.json").read_text())["moe_intermediate_size"]
    report = expand_experts.expand(TARGET_DIR, tmp_path, old + 64, seed=0, max_shard_bytes=8 * 10**6)
    assert report["shards"] > 1
    original = AutoModelForCausalLM.from_pretrained(TARGET_DIR, dtype=torch.float32).eval()
    expanded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert expanded.config.moe_intermediate_size == old + 64
    experts = expanded.model.layers[0].mlp.experts
    assert experts.down_proj.shape[-1] == old + 64
    ids = torch.randint(0, original.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(expanded(ids).logits, original(ids).logits, rtol=1e-5, atol=1e-5)


def test_rejects_narrowing(tmp_path):
    with pytest.raises(ValueError):
        expand_experts.expand(TARGET_DIR, tmp_path, 8, seed=0, max_shard_bytes=10**9)
