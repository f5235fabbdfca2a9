"""Next-layer expert predictor (HybriMoE impact-driven / AdapMoE style, no draft model).

The residual stream changes little from one layer to the next, so the hidden state entering MoE
layer l, pushed through the routers of layers l+1..l+d, is a good guess of their routing.

The guess is launched on the compute stream before the layer's one host sync and read back in
that same sync (the runner packs it with the routing), so predicting costs no sync, no thread and
no event; the runner then prefetches the guess on the compute thread. An earlier design handed
guesses to a worker thread, whose Python fought the compute thread for the GIL at every torch call
and made decode slower than not prefetching at all.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moe_serve.engine.experts.routing import Router, chosen_scores, expert_scores
from moe_serve.engine.experts.stats import ExpertStats


def token_topk(x: torch.Tensor, router_weight: torch.Tensor, k: int, router: Router = Router(),
               correction: torch.Tensor | None = None,
               logit_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's guess of a later layer's routing, chosen from x @ W^T (+ the router's own bias,
    gpt-oss's) as that layer's router chooses (softmax top-k, or the family's Router with its
    correction bias) as (scores, ids)."""
    logits = F.linear(x, router_weight, logit_bias)
    return chosen_scores(expert_scores(logits, router), k, router, correction)  # [T, k] each


def rank_by_impact(probs: torch.Tensor, ids: torch.Tensor, num_experts: int, limit: int) -> torch.Tensor:
    """Per target layer, the union of the tokens' guesses ordered by summed probability, at most
    `limit`; -1 pads. probs/ids [d, T*k] -> [d, limit]"""
    impact = torch.zeros(ids.shape[0], num_experts, device=probs.device).scatter_add_(1, ids, probs)  # [d, E]
    top = impact.topk(min(limit, num_experts), dim=-1)  # [d, m]
    return torch.where(top.values > 0, top.indices, torch.full_like(top.indices, -1))


@dataclass(frozen=True)
class Guess:
    """A launched, not yet read, prediction for the layers after some layer."""

    targets: range  # the predicted MoE layers
    top: tuple[torch.Tensor, torch.Tensor]  # each token's guess per target: (probs, ids) [T, d, k]
    ranked: torch.Tensor  # [d, m] expert ids to prefetch per target, most impact first, -1 = none

    def next_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token (probs, ids) [T, k] for targets[0]."""
        return self.top[0][:, 0], self.top[1][:, 0]


class NextLayerPredictor:
    def __init__(self, router_weights: Sequence[torch.Tensor], top_k: int, depth: int, stats: ExpertStats,
                 max_per_layer: int | None = None, router: Router = Router(),
                 corrections: Sequence[torch.Tensor] | None = None,
                 logit_biases: Sequence[torch.Tensor] | None = None) -> None:
        """`router_weights[l]` is MoE layer l's router [E, H] (`corrections[l]` its correction bias [E]
        where `router` has one, `logit_biases[l]` its linear's bias [E] where it has one); prefetch at most `max_per_layer` experts per predicted layer
        (default 2 * top_k, HybriMoE's p)."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        num_layers = len(router_weights)
        self.top_k = top_k
        self.max_per_layer = max_per_layer or 2 * top_k
        self.num_experts = router_weights[0].shape[0]
        self._targets = [range(l + 1, min(l + depth, num_layers - 1) + 1) for l in range(num_layers)]
        # one matmul per layer for all its targets: their routers stacked [d*E, H]
        self._stacked = [torch.cat([router_weights[t] for t in targets]) if targets else None
                         for targets in self._targets]
        self._stacked_biases = ([torch.cat([logit_biases[t] for t in targets]) if targets else None
                                 for targets in self._targets] if logit_biases is not None else None)  # [d*E]
        self.router = router
        # [d, E] per layer: its targets' correction biases
        self._corrections = ([torch.stack([corrections[t] for t in targets]) if targets else None
                              for targets in self._targets] if corrections is not None else None)
        self._stats = stats
        self._latest: dict[int, list[int]] = {}  # target layer -> guessed experts

    def guess(self, layer: int, x: torch.Tensor) -> Guess | None:
        """Launch the guess for the layers after `layer`, whose input is x [T, H]; no host sync.
        None when `layer` is the last one."""
        weight = self._stacked[layer]
        if weight is None:
            return None
        targets, t, e = self._targets[layer], x.shape[0], self.num_experts
        bias = None if self._stacked_biases is None else self._stacked_biases[layer]
        scores = expert_scores(F.linear(x, weight, bias).view(t * len(targets), e), self.router)  # [T*d, E]
        correction = None if self._corrections is None else self._corrections[layer].repeat(t, 1)  # [T*d, E]
        top = tuple(v.view(t, len(targets), -1) for v in chosen_scores(scores, self.top_k, self.router,
                                                                         correction))  # [T, d, k] each
        if t == 1:  # one token's top-k is already its impact order: spare the ranking's launches
            return Guess(targets, top, top[1][0, :, : self.max_per_layer])
        values, ids = (v.transpose(0, 1).reshape(len(targets), -1) for v in top)  # [d, T*k] each
        return Guess(targets, top, rank_by_impact(values, ids, e, self.max_per_layer))

    def remember(self, guess: Guess, ranked: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
        """Take the guess as read back on the host ([d][m]); return the (layer, expert) keys to prefetch."""
        guessed = {target: [e for e in row if e >= 0] for target, row in zip(guess.targets, ranked)}
        self._latest.update(guessed)
        return [(target, e) for target, experts in guessed.items() for e in experts]

    def record_used(self, layer: int, used: Sequence[int]) -> None:
        """Score the latest guess for `layer` against the experts it actually used."""
        predicted = self._latest.pop(layer, None)
        if predicted is not None:
            self._stats.add(layer, predicted_correct=len(set(predicted).intersection(used)),
                            predicted_needed=len(used))
