"""Both expert compute paths equal a plain per-token reference."""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.experts.compute import (
    accumulate_experts,
    gathered_experts,
    gathered_experts_torch,
    swiglu_expert,
)
from moe_serve.engine.experts.layout import ExpertLayout
from tests.engine.experts.slot_rows import (
    GPT_OSS_EXPERTS,
    GPT_OSS_INPUT_SCALE,
    clamp_binds,
    quant_layout,
    random_slots,
)


def _setup(seed: int = 0, t: int = 5, k: int = 3, e: int = 6):
    gen = torch.Generator().manual_seed(seed)
    layout = ExpertLayout(hidden_size=16, intermediate_size=24, dtype=torch.float64)
    expert_slots = torch.randn(e, layout.numel, generator=gen, dtype=torch.float64)
    x = torch.randn(t, 16, generator=gen, dtype=torch.float64)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])  # [T, k]
    weights = torch.rand(t, k, generator=gen, dtype=torch.float64)
    return layout, expert_slots, x, ids, weights


def _reference(layout, expert_slots, x, ids, weights):
    return torch.stack([
        sum(weights[t, j] * swiglu_expert(x[t : t + 1], expert_slots[ids[t, j]], layout)[0]
            for j in range(ids.shape[1]))
        for t in range(x.shape[0])
    ])


def test_grouped_and_gathered_match_reference():
    layout, expert_slots, x, ids, weights = _setup()
    expected = _reference(layout, expert_slots, x, ids, weights)
    grouped = torch.zeros_like(x)
    accumulate_experts(grouped, x, ids, weights, {e: expert_slots[e] for e in range(expert_slots.shape[0])}, layout)
    torch.testing.assert_close(grouped, expected)
    # expert slot ids differ from expert ids: the gather must follow the expert slot map, not the expert id
    perm = torch.randperm(expert_slots.shape[0], generator=torch.Generator().manual_seed(3))
    shuffled = torch.empty_like(expert_slots)
    shuffled[perm] = expert_slots
    torch.testing.assert_close(gathered_experts(x, weights, shuffled, perm[ids], layout), expected)


def test_grouped_skips_absent_experts_for_later_waves():
    layout, expert_slots, x, ids, weights = _setup(seed=1)
    first, second = {0, 1, 2}, {3, 4, 5}
    out = torch.zeros_like(x)
    accumulate_experts(out, x, ids, weights, {e: expert_slots[e] for e in first}, layout)
    accumulate_experts(out, x, ids, weights, {e: expert_slots[e] for e in second}, layout)
    torch.testing.assert_close(out, _reference(layout, expert_slots, x, ids, weights))


def _expert_formula(layout, expert_slots, x, ids, weights):
    """Each token's experts one by one, written out: gate_up = W_gate_up x + b_gate_up; act =
    silu(gate) * up, or gpt-oss's (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with
    g = min(gate, limit); y = W_down act + b_down, then weighted. On the dequantized weights."""
    act = layout.activation
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            row = expert_slots[ids[t, j]]
            gate_up = layout.gate_up(row) @ x[t]  # [2I]
            if layout.biases:
                gate_up = gate_up + layout.bias(row, "gate_up")
            gate, up = gate_up.chunk(2)
            if act.kind == "clamped_swiglu":
                gate = torch.clamp(gate, max=act.limit)
                h = (torch.clamp(up, -act.limit, act.limit) + 1) * gate * torch.sigmoid(act.alpha * gate)
            else:
                h = gate * torch.sigmoid(gate) * up
            y = layout.down(row) @ h  # [H]
            if layout.biases:
                y = y + layout.bias(row, "down")
            out[t] += weights[t, j] * y
    return out


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("experts", ["default", "gpt_oss"])
def test_torch_paths_compute_the_experts_formula(quant, experts):
    """The default layout keeps silu(gate) * up without biases; gpt-oss's adds its biases (down's before
    the routing weight) around the clamped SwiGLU, here with inputs large enough for the clamps to bind."""
    gen = torch.Generator().manual_seed(2)
    gpt_oss = experts == "gpt_oss"
    layout = quant_layout(16, 24, torch.float64, quant, **(GPT_OSS_EXPERTS if gpt_oss else {}))
    expert_slots = random_slots(layout, 6, gen)
    x = torch.randn(5, 16, generator=gen, dtype=torch.float64) * (GPT_OSS_INPUT_SCALE if gpt_oss else 1)
    ids = torch.stack([torch.randperm(6, generator=gen)[:3] for _ in range(5)])  # [T, k]
    weights = torch.rand(5, 3, generator=gen, dtype=torch.float64)
    assert not gpt_oss or clamp_binds(layout, expert_slots, x, ids)
    expected = _expert_formula(layout, expert_slots, x, ids, weights)
    torch.testing.assert_close(gathered_experts_torch(x, weights, expert_slots, ids, layout), expected)
    grouped = torch.zeros_like(x)
    accumulate_experts(grouped, x, ids, weights, {e: expert_slots[e] for e in range(6)}, layout)
    torch.testing.assert_close(grouped, expected)
