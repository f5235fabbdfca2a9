"""What a model's router hands to the expert side, and the interface that runs routed experts.

Models decide *which* experts and with what weights (family-specific softmax/top-k/normalise);
an ExpertRunner decides *where* the weights come from (resident slot, demand copy, prefetch).
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
    router_probs: torch.Tensor  # [T, E] softmax over all experts (scores for MRS, traces, predictors)


class ExpertRunner(Protocol):
    def run(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        """Return sum_k weight[t,k] * expert_{id[t,k]}(x[t]) as [T, H]."""
        ...
