"""CachedExpertRunner: the data path of one MoE layer over the GPU expert cache.

Per layer: one host sync to learn which experts are needed; pin the resident ones and start all
missing ones' demand copies together; predict and prefetch later layers; compute the resident
experts while the copies fly; then wait on each missing expert's own event and compute them. If
the layer needs more experts than the cache can hold at once (a long verify pass, a tiny
budget) it runs in waves: fill, compute, unpin, refill. Caching never changes the math.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from engine.config import EngineConfig, parse_budget
from engine.experts.cache import CopyFn, ExpertCache, ExpertSource, Wave, copy_row
from engine.experts.compute import accumulate_experts, gathered_experts
from engine.experts.policies import MRSPolicy, make_policy
from engine.experts.predictor import NextLayerPredictor, token_topk
from engine.experts.prefetch import PrefetchWorker
from engine.experts.routing import LayerRouting
from engine.experts.stats import StatsSnapshot

PREFETCH_MODES = ("none", "next-layer")


class RoutingObserver(Protocol):
    def on_layer(self, routing: LayerRouting, next_guess: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """`next_guess`: the next-layer predictor's per-token (probs, ids) [T, k] for layer + 1."""


def layer_scores(router_probs: torch.Tensor, top_p: int) -> torch.Tensor:
    """MRS's s for one layer run: per token only its top-p probabilities, averaged over tokens. [E]"""
    top = router_probs.float().topk(min(top_p, router_probs.shape[-1]), dim=-1)  # [T, p]
    scores = torch.zeros(router_probs.shape[-1], device=router_probs.device)
    return scores.scatter_add_(0, top.indices.reshape(-1), top.values.reshape(-1)) / router_probs.shape[0]


class CachedExpertRunner:
    def __init__(self, store: ExpertSource, budget: int | float | None, policy: str = "lru",
                 device: torch.device | str = "cpu", *, top_k: int, prefetch: str = "none",
                 prefetch_depth: int = 1, copy_fn: CopyFn = copy_row,
                 observer: RoutingObserver | None = None) -> None:
        """`budget`: bytes (int), fraction of all expert bytes (float) or None for all experts."""
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"unknown prefetch mode {prefetch!r}; choose one of {', '.join(PREFETCH_MODES)}")
        self.layout = store.layout
        self.num_layers = store.num_layers
        self.top_k = top_k
        self.prefetch_depth = prefetch_depth
        eviction = make_policy(policy, top_k)
        self._mrs_top_p = eviction.top_p if isinstance(eviction, MRSPolicy) else None
        self.cache = ExpertCache(store, budget, eviction, device, top_k, copy_fn)
        self.prefetch_mode = prefetch
        self._worker = PrefetchWorker(self.cache, lambda: self._runs) if prefetch != "none" else None
        self._observer = observer
        self._router_weights: list[torch.Tensor] = []
        self._predictor: NextLayerPredictor | None = None
        self._runs = 0  # layer runs started, the prefetch worker's clock

    @classmethod
    def from_config(cls, store: ExpertSource, config: EngineConfig, *, top_k: int,
                    observer: RoutingObserver | None = None) -> CachedExpertRunner:
        budget = parse_budget(config.gpu_expert_budget) if config.gpu_expert_budget is not None else None
        return cls(store, budget, config.cache_policy, config.device, top_k=top_k, prefetch=config.prefetch,
                   prefetch_depth=config.prefetch_depth, observer=observer)

    def set_router_weights(self, weights: Sequence[torch.Tensor]) -> None:
        """Hook in the model's routers ([E, H] per MoE layer) for the predictor and traces."""
        self._router_weights = list(weights)
        if self.prefetch_mode == "next-layer":
            self._predictor = NextLayerPredictor(self._router_weights, self.top_k, self.prefetch_depth,
                                                 self._worker.submit, self.cache.stats)

    def run(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        if self.prefetch_mode == "next-layer" and self._predictor is None:
            raise RuntimeError("prefetch='next-layer' needs set_router_weights(model.router_weights()) first")
        self._runs += 1
        layer = routing.layer
        if self.graph_safe and x.shape[0] == 1:
            return self._run_resident(x, routing)
        used, experts = self._needed(routing)
        if self._predictor is not None:
            self._predictor.record_used(layer, experts)
        out = torch.zeros_like(x)  # [T, H]
        wave = self.cache.acquire(layer, experts)
        next_guess = self._look_ahead(layer, x)  # after pinning: prefetch cannot evict this layer
        if self._observer is not None:
            self._observer.on_layer(routing, next_guess)
        while True:
            try:
                if x.shape[0] == 1 and not wave.leftover:
                    return self._compute_gathered(x, routing, wave, used)
                self._compute(out, x, routing, wave)
            finally:
                self.cache.release(wave)
            if not wave.leftover:
                return out
            wave = self.cache.acquire(layer, wave.leftover)

    @property
    def layer_runs(self) -> int:
        """MoE layer runs started so far: the clock prefetch deadlines are measured in."""
        return self._runs

    def prefetch_worker(self) -> PrefetchWorker:
        """The prefetch worker, started on first use (speculative decoding prefetches without --prefetch)."""
        if self._worker is None:
            self._worker = PrefetchWorker(self.cache, lambda: self._runs)
        return self._worker

    @property
    def graph_safe(self) -> bool:
        """Every expert resident and no per-layer observer: one-token layers need no host sync."""
        return self.cache.resident_slots is not None and self._observer is None

    def _run_resident(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        """One token, every expert resident: no host sync, so CUDA graphs can capture it.

        Counted as the token's k distinct experts, all hits; while a graph is being captured
        nothing is counted — a replay runs no Python, so the graph's owner counts replays."""
        if not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.cache.stats.add(routing.layer, hits=routing.expert_ids.shape[1])
        slot_ids = self.cache.resident_slots[routing.layer][routing.expert_ids]  # [1, k]
        return gathered_experts(x, routing.expert_ids, routing.expert_weights, self.cache.slots, slot_ids,
                                self.layout)

    def count_replayed_token(self, experts_per_layer: int) -> None:
        """Book one token replayed by a CUDA graph: each MoE layer used that many resident experts."""
        for layer in range(self.num_layers):
            self.cache.stats.add(layer, hits=experts_per_layer)

    def finish_step(self) -> None:
        """Call once per engine step, after the step's natural sync (the sampled token was read)."""
        self.cache.finish_step()
        if self._worker is not None:
            self._worker.raise_if_failed()

    def stats(self) -> StatsSnapshot:
        return self.cache.stats.snapshot()

    @property
    def resident_experts(self) -> int:
        return self.cache.resident_experts

    def wait_prefetch_idle(self) -> None:
        """Block until queued prefetches are done (tests and benchmarks that want determinism)."""
        if self._worker is not None:
            self._worker.wait_idle()

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()

    def _needed(self, routing: LayerRouting) -> tuple[torch.Tensor, list[int]]:
        """The layer's distinct experts — as a device 0/1 mask [E] and a sorted host list — and the
        MRS scores, with the layer's one host sync."""
        probs = routing.router_probs  # [T, E]
        used = torch.zeros(probs.shape[-1], device=probs.device).index_fill_(0, routing.expert_ids.reshape(-1), 1.0)
        if self._mrs_top_p is None:
            return used, [e for e, u in enumerate(used.tolist()) if u]
        used_list, scores = torch.stack([used, layer_scores(probs, self._mrs_top_p)]).tolist()  # [2, E]
        self.cache.observe_scores(routing.layer, scores)
        return used, [e for e, u in enumerate(used_list) if u]

    def _look_ahead(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._predictor is not None:
            return self._predictor.predict(layer, x, self._runs)
        if self._observer is not None and layer + 1 < len(self._router_weights):
            return token_topk(x, self._router_weights[layer + 1], self.top_k)
        return None

    def _compute_gathered(self, x: torch.Tensor, routing: LayerRouting, wave: Wave, used: torch.Tensor) -> torch.Tensor:
        """One token whose experts all fit in this wave: wait for its copies, then one gathered
        batched matmul instead of a launch train and two host syncs per expert group."""
        for expert, _, ready in wave.pending:
            self.cache.wait(wave.layer, expert, ready)
        slot_of_rank = torch.tensor([wave.slots[e] for e in sorted(wave.slots)], device=x.device)  # [n]
        rank = used.cumsum(0).long() - 1  # [E]: position of each used expert among the sorted used ones
        slot_ids = slot_of_rank[rank[routing.expert_ids]]  # [1, k]
        return gathered_experts(x, routing.expert_ids, routing.expert_weights, self.cache.slots, slot_ids,
                                self.layout)

    def _compute(self, out: torch.Tensor, x: torch.Tensor, routing: LayerRouting, wave: Wave) -> None:
        ids, weights = routing.expert_ids, routing.expert_weights  # [T, k] each
        if wave.rows:  # runs while the wave's copies are in flight
            accumulate_experts(out, x, ids, weights, wave.rows, self.layout)
        if not wave.pending:
            return
        for expert, _, ready in wave.pending:
            self.cache.wait(wave.layer, expert, ready)
        # One call for all copied experts: each accumulate_experts call syncs the host twice
        # (~0.4 ms on H100), more than one expert's copy takes, so per-expert calls lose.
        accumulate_experts(out, x, ids, weights, {e: row for e, row, _ in wave.pending}, self.layout)
