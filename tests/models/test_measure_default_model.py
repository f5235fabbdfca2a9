"""The measurement script's speculative-decoding simulation and routing scores are exact."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import measure_default_model as mdm  # noqa: E402


@pytest.fixture(scope="module")
def target():
    return AutoModelForCausalLM.from_pretrained(REPO / "moe_serve" / "models" / "default", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(target):
    return torch.randint(4, target.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))


def test_a_drafter_identical_to_the_target_is_always_accepted(target, prompts):
    result = mdm.acceptance(target, target, prompts, new_tokens=12, gamma=4)
    assert result["acceptance_rate"] == 1.0


@torch.no_grad()
def test_cached_drafter_proposes_what_plain_greedy_does(target, prompts):
    prompt = prompts[0]
    state = mdm.GreedyDrafter(target, prompt)
    first = state.draft(3)
    assert first == mdm.greedy(target, prompt, 3).tolist()
    # the target rejects the third token: the cache must drop it and continue from the truth
    truth = prompt.tolist() + first[:2] + [7]
    state.advance(truth)
    assert state.draft(3) == mdm.greedy(target, torch.tensor(truth), 3).tolist()


def test_self_drafter_routes_top1_and_leaves_the_target_alone(target):
    drafter = mdm.self_drafter(target)
    assert {layer.mlp.gate.top_k for layer in drafter.model.layers} == {1}
    assert {layer.mlp.gate.top_k for layer in target.model.layers} == {target.config.num_experts_per_tok}


def test_overlap_counts_shared_experts_over_k():
    pred = torch.tensor([[0, 1], [2, 3], [4, 5]])
    true = torch.tensor([[1, 0], [3, 6], [6, 7]])
    assert mdm.overlap(pred, true).tolist() == [1.0, 0.5, 0.0]


def test_perplexity_is_cross_entropy_without_the_routers_balance_loss(target):
    windows = torch.randint(4, target.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    report, _ = mdm.measure_windows(target, target, windows, batch_size=2)
    with torch.no_grad():
        ce = target(input_ids=windows, labels=windows).loss.item()  # no router logits: no aux term
        with_aux = target(input_ids=windows, labels=windows, output_router_logits=True).loss.item()
    assert with_aux > ce  # what the script once reported for the target
    assert report["perplexity"]["target"] == pytest.approx(math.exp(ce), rel=1e-4)
    assert report["perplexity"]["draft"] == pytest.approx(math.exp(ce), rel=1e-4)
