"""What a model's router hands to the expert side, and the interface that runs routed experts.

Models decide *which* experts and with what weights (family-specific softmax/top-k/normalise);
an ExpertRunner decides *where* the weights come from (resident expert slot, demand copy, prefetch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class LayerRouting:
    layer: int  # index among the model's MoE layers
    expert_ids: torch.Tensor  # [T, k] int64, chosen experts per token
    expert_weights: torch.Tensor  # [T, k] combine weights, already normalised as the family says
    # [T, E] every expert's score, softmax (DeepSeek-V3: sigmoid): for MRS, traces, predictors
    router_probs: torch.Tensor
    # SS-MoE self-draft (expert_ids are each token's best r of its top-k): the full top-k [T, K],
    # best first. A runner may run other r of these instead, the resident ones first, weighted
    # by `reweighted`: a draft only has to be cheap, the verify pass decides what is kept.
    candidates: torch.Tensor | None = None
    normalize: bool = False  # the family renormalises the chosen experts' probabilities
    scale: float = 1.0  # and then scales them (DeepSeek's routed_scaling_factor)

    def reweighted(self, expert_ids: torch.Tensor) -> torch.Tensor:
        """Combine weights [T, r] for other chosen experts [T, r] (device), as the family weighs them."""
        weights = self.router_probs.gather(1, expert_ids)  # [T, r] fp32
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.scale if self.scale != 1.0 else weights


def resident_first(candidates: list[int], r: int, missing: set[int]) -> list[int]:
    """The r experts a draft runs out of a token's ranked candidates: resident ones first, by rank."""
    return sorted(candidates, key=lambda e: e in missing)[:r]  # stable: rank order within each group


class ExpertRunner(Protocol):
    def run(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        """Return sum_k weight[t,k] * expert_{id[t,k]}(x[t]) as [T, H]."""
        ...
