"""What a model's router hands to the expert side, and the interface that runs routed experts.

Models decide *which* experts and with what weights (family-specific softmax/top-k/normalise, or
a Router's variant: sigmoid scores, groups, a correction bias); an ExpertRunner decides *where*
the weights come from (resident expert slot, demand copy, prefetch). The Router's choice is here,
torch only, so that the predictors guessing a later layer's experts choose as its block will.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


ROUTER_SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")


@dataclass(frozen=True)
class Router:
    """How a token's experts are chosen and weighed beyond softmax -> top-k (-> renormalise):
    DeepSeek scores by sigmoid (V3) and picks only among the topk_groups best of `groups` expert
    groups, a group scored by its best expert (V2) or its best two (V3); V3 adds a per-expert
    correction bias to the scores it picks by (never to the weights); the weights are scaled."""

    scoring: str = "softmax"  # softmax | sigmoid
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"  # max | top2
    correction_bias: bool = False
    scaling: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router scoring {self.scoring!r} not in {ROUTER_SCORINGS}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group score {self.group_score!r} not in {GROUP_SCORES}")
        if not 1 <= self.topk_groups <= self.groups:
            raise ValueError(f"topk_group={self.topk_groups} must be in 1..n_group={self.groups}")


def expert_scores(router_logits: torch.Tensor, router: Router) -> torch.Tensor:
    """Every expert's score [..., E] fp32 from router logits [..., E]: softmax, or DeepSeek-V3's sigmoid."""
    logits = router_logits.float()
    return torch.sigmoid(logits) if router.scoring == "sigmoid" else torch.softmax(logits, dim=-1)


def choose_experts(scores: torch.Tensor, top_k: int, router: Router,
                   correction: torch.Tensor | None = None) -> torch.Tensor:
    """The top-k experts [N, k] by score [N, E] (plus `correction`, broadcast to it), best first,
    only among each row's topk_groups best groups when the router groups its experts."""
    choice = scores if correction is None else scores + correction
    if router.groups > 1:
        grouped = choice.view(choice.shape[0], router.groups, -1)  # [N, G, E/G]
        group_scores = (grouped.amax(dim=-1) if router.group_score == "max"
                        else grouped.topk(2, dim=-1).values.sum(dim=-1))  # [N, G]
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(
            1, group_scores.topk(router.topk_groups, dim=-1).indices, True)  # [N, G]
        choice = grouped.masked_fill(~kept[..., None], float("-inf")).flatten(1)  # [N, E]
    return torch.topk(choice, top_k, dim=-1).indices


def chosen_scores(scores: torch.Tensor, top_k: int, router: Router,
                  correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, expert ids) [N, k] of the experts choose_experts picks from scores [N, E]: one top-k
    where the router neither groups nor corrects."""
    if router.groups == 1 and correction is None:
        top = scores.topk(top_k, dim=-1)
        return top.values, top.indices
    ids = choose_experts(scores, top_k, router, correction)
    return scores.gather(-1, ids), ids


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
