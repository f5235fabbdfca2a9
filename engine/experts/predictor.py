"""Next-layer expert predictor (HybriMoE impact-driven / AdapMoE style, no draft model).

The residual stream changes little from one layer to the next, so the hidden state entering MoE
layer l, pushed through the routers of layers l+1..l+d, is a good guess of their routing. The
guess is computed on the compute stream with fixed-size tensors only (no host sync), copied to
the host asynchronously, and handed to the PrefetchWorker with an event it waits on.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.experts.prefetch import PrefetchTask
from engine.experts.stats import ExpertStats


def token_topk(x: torch.Tensor, router_weight: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's guess of a later layer's routing: top-k of softmax(x @ W^T) as (probs, ids)."""
    probs = F.linear(x, router_weight).float().softmax(dim=-1)  # [T, E]
    top = probs.topk(k, dim=-1)
    return top.values, top.indices  # [T, k] each


def rank_by_impact(probs: torch.Tensor, ids: torch.Tensor, num_experts: int, limit: int) -> torch.Tensor:
    """Union of the tokens' guesses ordered by summed probability, at most `limit`; -1 pads. [limit]"""
    impact = torch.zeros(num_experts, device=probs.device).scatter_add_(0, ids.reshape(-1), probs.reshape(-1))
    top = impact.topk(min(limit, num_experts))  # [m]
    return torch.where(top.values > 0, top.indices, torch.full_like(top.indices, -1))


class NextLayerPredictor:
    def __init__(self, router_weights: Sequence[torch.Tensor], top_k: int, depth: int,
                 submit: Callable[[PrefetchTask], None], stats: ExpertStats,
                 max_per_layer: int | None = None) -> None:
        """`router_weights[l]` is MoE layer l's router [E, H]; prefetch at most `max_per_layer`
        experts per predicted layer (default 2 * top_k, HybriMoE's p)."""
        if depth < 1:
            raise ValueError(f"prefetch depth must be >= 1, got {depth}")
        self.router_weights = list(router_weights)
        self.top_k = top_k
        self.depth = depth
        self.max_per_layer = max_per_layer or 2 * top_k
        self._submit = submit
        self._stats = stats
        self._latest: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}  # layer -> guess

    def predict(self, layer: int, x: torch.Tensor, run_index: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Submit prefetches for the layers after `layer`, whose input is x [T, H].

        `run_index` is the index of the current layer run; returns the per-token guess (probs,
        ids) [T, k] for layer + 1, or None when `layer` is the last one.
        """
        targets = range(layer + 1, min(layer + self.depth, len(self.router_weights) - 1) + 1)
        guesses = [token_topk(x, self.router_weights[t], self.top_k) for t in targets]
        if not guesses:
            return None
        num_experts = self.router_weights[layer].shape[0]
        ranked = torch.stack([rank_by_impact(p, i, num_experts, self.max_per_layer) for p, i in guesses])  # [d, m]
        host, ready = _to_host(ranked)
        for j, target in enumerate(targets):
            self._latest[target] = (host[j], ready)
            self._submit(PrefetchTask(layer=target, experts=host[j], ready=ready, due=run_index + j + 1))
        return guesses[0]

    def record_used(self, layer: int, used: Sequence[int]) -> None:
        """Score the latest guess for `layer` against the experts it actually used."""
        guess = self._latest.pop(layer, None)
        if guess is None:
            return
        ids, ready = guess
        if ready is not None:
            ready.synchronize()  # long done: the layers in between synced on their routing
        predicted = {e for e in ids.tolist() if e >= 0}
        self._stats.add(layer, predicted_correct=len(predicted.intersection(used)), predicted_needed=len(used))


def _to_host(t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Asynchronous device->host copy (pinned destination) plus the event that marks it done."""
    if t.device.type != "cuda":
        return t, None
    host = t.to("cpu", non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
