"""Grouped SwiGLU expert compute: each expert runs once over all the tokens routed to it."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moe_serve.engine.experts.layout import ExpertLayout

# T*k from which gathered_experts takes the grouped kernel over the per-pair fused GEMVs. On an
# H100 with uniform top-k routing (bench/results/kernels/grouped_experts.json) Mixtral-size experts
# (8, top-2) cross over at 8 pairs (1.16x at 16, 1.7x at 32, 6.3x at 128); OLMoE-size (64, top-8)
# at ~100 (0.94x at 16-32, 0.98x at 64, 1.15x at 128, 3.5x at 512): 16 takes the large wins and
# costs OLMoE at most ~6% at 2-8 tokens.
GROUPED_MIN_PAIRS = 16


def swiglu_expert(x: torch.Tensor, row: torch.Tensor, layout: ExpertLayout) -> torch.Tensor:
    """One expert over its tokens: x [N, H] -> [N, H]. A quantized row is decoded first (the reference
    dequantization, into x's dtype); the layout's biases (None without) and activation apply."""
    gate, up = F.linear(x, layout.gate_up(row), layout.bias(row, "gate_up")).chunk(2, dim=-1)  # [N, I] each
    return F.linear(layout.activation(gate, up), layout.down(row), layout.bias(row, "down"))


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


def reads_expert_slots_in_place(x: torch.Tensor, expert_slots: torch.Tensor, layout: ExpertLayout) -> bool:
    """Whether gathered_experts runs the Triton kernels, which read the routed expert slots where
    they lie (any number of tokens then costs no copy of weight rows); otherwise it gathers T*k rows."""
    if not x.is_cuda:
        return False
    from moe_serve.engine.experts import fused_experts as fused  # imports triton: only on the GPU path

    return fused.fused_experts_supported(x, expert_slots, layout)  # the grouped kernel has the same requirements


def gathered_experts(
    x: torch.Tensor, expert_weights: torch.Tensor, expert_slots: torch.Tensor, expert_slot_ids: torch.Tensor,
    layout: ExpertLayout, routed_experts: int | None = None,
) -> torch.Tensor:
    """All routed experts of the tokens at once, with no host sync: graph-capturable.

    x [T, H]; expert_weights/expert_slot_ids [T, k] (each token's experts by the expert slot
    holding them); expert_slots [S, numel] holds every needed expert. Where the kernels read the
    routed expert slots in place (reads_expert_slots_in_place): from GROUPED_MIN_PAIRS (token,
    expert) pairs on, the grouped kernel, which reads each expert slot once per block of its tokens;
    below, the fused GEMVs, one per pair. Both decode quantized rows as they load them. Elsewhere
    the torch path gathers the rows: worth it only while T*k is small (decode, short verify spans);
    long CPU prefills use accumulate_experts. routed_experts: the layer's expert count, the most
    distinct slots expert_slot_ids can name (None: S), which sizes the grouped kernel's grid.
    """
    if reads_expert_slots_in_place(x, expert_slots, layout):
        from moe_serve.engine.experts import fused_experts as fused
        from moe_serve.engine.experts import grouped_experts as grouped

        if expert_slot_ids.numel() >= GROUPED_MIN_PAIRS:
            return grouped.grouped_experts(x, expert_weights, expert_slots, expert_slot_ids, layout,
                                           routed_experts=routed_experts)
        return fused.fused_experts(x, expert_weights, expert_slots, expert_slot_ids, layout)
    return gathered_experts_torch(x, expert_weights, expert_slots, expert_slot_ids, layout)


def gathered_experts_torch(
    x: torch.Tensor, expert_weights: torch.Tensor, expert_slots: torch.Tensor, expert_slot_ids: torch.Tensor,
    layout: ExpertLayout,
) -> torch.Tensor:
    """The reference and CPU path of gathered_experts: copy the T*k weight rows out of their
    expert slots (decoding quantized ones), then two batched matmuls (biases added before the
    routing weights apply, as each expert's own output)."""
    t, k = expert_slot_ids.shape
    h = layout.hidden_size
    rows = expert_slots.index_select(0, expert_slot_ids.reshape(-1))  # [T*k, numel]
    xk = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
    gate, up = _batched_projection(layout, rows, "gate_up", xk).chunk(2, dim=-1)  # [T*k, I] each
    y = _batched_projection(layout, rows, "down", layout.activation(gate, up).unsqueeze(-1))  # [T*k, H]
    return (y.view(t, k, h) * expert_weights.unsqueeze(-1).to(y.dtype)).sum(dim=1)  # [T, H]


def _batched_projection(layout: ExpertLayout, rows: torch.Tensor, matrix: str, v: torch.Tensor) -> torch.Tensor:
    """Each row's matrix [T*k, N, K] (decoded) times its vector v [T*k, K, 1], plus its bias: [T*k, N]."""
    bias = layout.bias(rows, matrix)  # [T*k, N] or None
    w = layout.weights(rows, matrix)
    return (torch.bmm(w, v) if bias is None else torch.baddbmm(bias.unsqueeze(-1), w, v)).squeeze(-1)
