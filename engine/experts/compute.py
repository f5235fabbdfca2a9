"""Grouped SwiGLU expert compute: each expert runs once over all the tokens routed to it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.experts.layout import ExpertLayout


def swiglu_expert(x: torch.Tensor, row: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """One expert over its tokens: x [N, H] -> [N, H]."""
    gate, up = F.linear(x, layout.gate_up(row)).chunk(2, dim=-1)  # [N, I] each
    return F.linear(F.silu(gate) * up, layout.down(row))


def accumulate_experts(
    out: torch.Tensor,
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    rows: dict[int, torch.Tensor],
    layout: ExpertLayout,
) -> None:
    """Add the contribution of the experts in `rows` (expert id -> packed weight row) into out [T, H].

    Tokens are grouped by expert with one sort, so the Python loop runs over experts, never
    over tokens. Experts routed but absent from `rows` are skipped: callers run them in a later
    wave once their weights are resident.
    """
    flat_ids = expert_ids.reshape(-1)  # [T*k]
    order = torch.argsort(flat_ids, stable=True)
    sorted_ids = flat_ids[order]
    token_of = order // expert_ids.shape[1]  # [T*k] token index of each sorted assignment
    weight_of = expert_weights.reshape(-1)[order]
    present, counts = torch.unique_consecutive(sorted_ids, return_counts=True)
    start = 0
    for expert, count in zip(present.tolist(), counts.tolist()):
        if expert in rows:
            tokens = token_of[start : start + count]
            y = swiglu_expert(x[tokens], rows[expert], layout)  # [n, H]
            out.index_add_(0, tokens, y * weight_of[start : start + count, None].to(y.dtype))
        start += count
