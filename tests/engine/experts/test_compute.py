"""Both expert compute paths equal a plain per-token reference."""
from __future__ import annotations

import torch

from moe_serve.engine.experts.compute import accumulate_experts, gathered_experts, swiglu_expert
from moe_serve.engine.experts.layout import ExpertLayout


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
