"""Upcycling the dense draft into the MoE target starts from the same function."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, Qwen3ForCausalLM

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import train_default_model as tdm  # noqa: E402


def tiny_pair(noise: float):
    tok = AutoTokenizer.from_pretrained(tdm.TARGET_DIR)
    recipe = replace(tdm.Recipe(), upcycle_noise=noise)
    torch.manual_seed(0)
    draft = Qwen3ForCausalLM(tdm.draft_config(tdm.SMOKE_SHAPE, tok)).eval()
    gen = torch.Generator().manual_seed(0)
    target = tdm.upcycle(draft, tdm.target_config(tdm.SMOKE_SHAPE, tok, recipe), recipe, gen).eval()
    return draft, target


def test_upcycled_target_without_noise_equals_draft():
    draft, target = tiny_pair(noise=0.0)
    ids = torch.randint(0, tdm.SMOKE_SHAPE.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, draft(ids).logits, rtol=1e-5, atol=1e-5)


def test_upcycling_noise_breaks_expert_symmetry():
    _, target = tiny_pair(noise=0.01)
    experts = target.model.layers[0].mlp.experts.gate_up_proj  # [E, 2I, H]
    assert not torch.equal(experts[0], experts[1])
    assert torch.allclose(experts[0], experts[1], atol=0.1 * experts.abs().max().item())


def test_copy_shared_parts_leaves_the_mlp():
    draft, target = tiny_pair(noise=0.01)
    with torch.no_grad():
        target.model.layers[0].self_attn.q_proj.weight.add_(1.0)
    mlp_before = draft.model.layers[0].mlp.up_proj.weight.clone()
    tdm.copy_shared_parts(target, draft)
    assert torch.equal(draft.model.layers[0].self_attn.q_proj.weight, target.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(draft.model.layers[0].mlp.up_proj.weight, mlp_before)


def test_residual_tap_sees_what_the_router_sees():
    _, target = tiny_pair(noise=0.01)
    tap = tdm.ResidualTap(target)
    ids = torch.randint(0, tdm.SMOKE_SHAPE.vocab_size, (1, 12))
    with torch.no_grad():
        out = target(ids, output_router_logits=True)
        for layer, residual, logits in zip(target.model.layers, tap.residuals, out.router_logits):
            normed = layer.post_attention_layernorm(residual.reshape(-1, residual.shape[-1]))
            torch.testing.assert_close(normed @ layer.mlp.gate.weight.T, logits)
    tap.close()


def test_balance_loss_is_one_when_balanced_and_grows_on_collapse():
    tokens, experts = 64, 8
    uniform = torch.zeros(tokens, experts)
    collapsed = torch.zeros(tokens, experts)
    collapsed[:, :2] = 20.0  # every token on experts 0 and 1
    assert tdm.balance_loss((uniform, uniform), top_k=2).item() == pytest.approx(1.0)
    assert tdm.balance_loss((collapsed,), top_k=2).item() == pytest.approx(experts / 2, rel=1e-3)


def test_expert_dropout_acts_only_in_training_and_unwraps_cleanly():
    _, target = tiny_pair(noise=0.01)
    ids = torch.randint(0, tdm.SMOKE_SHAPE.vocab_size, (2, 16))
    keys = set(target.state_dict())
    with torch.no_grad():
        reference = target(ids).logits
        tdm.set_expert_dropout(target, 0.5)
        assert set(target.state_dict()) == keys  # nothing new is saved
        torch.testing.assert_close(target.eval()(ids).logits, reference, rtol=0, atol=0)
        assert not torch.allclose(target.train()(ids).logits, reference)  # the experts call act_fn
        tdm.set_expert_dropout(target, 0.0)
        assert not any(isinstance(m, tdm.ExpertDropout) for m in target.modules())
        torch.testing.assert_close(target.train()(ids).logits, reference, rtol=0, atol=0)
