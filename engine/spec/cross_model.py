"""Predicting the verify pass's experts while drafting (SP-MoE Algorithm 1).

At each drafting layer that the layer map ties to target MoE layers, the drafting model's
attention output h (the residual stream after attention, which the model hands to
`on_attention_output`) goes through the *target's* post-attention norm and router; the top-k
experts are what the verify pass will likely route this token to. They become prefetch tasks at
once, so the copies overlap the rest of drafting. The worker drops experts that are already
resident or in flight (Algorithm 1's cached-queue check, done where the cache lock is held).

The same predictor serves self-speculation: there the drafting model is the target itself running
r of its top-k experts and the layer map is the identity; the worker drops the experts the draft
just ran (resident), which leaves SS-MoE's incremental loads of the others.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Protocol

import torch

from engine.experts.prefetch import PrefetchTask, PrefetchWorker
from engine.models.blocks import CausalLM, MoEBlock
from engine.spec.stats import SpecStats

RouteFn = Callable[[int, torch.Tensor], torch.Tensor]  # (target MoE layer, h [T, H]) -> expert ids [T, k]


class PrefetchSink(Protocol):
    def submit(self, layer: int, experts: torch.Tensor) -> None:
        """Queue experts [m] (int64, any device, most important first) of target MoE layer `layer`."""
        ...


def target_router(model: CausalLM) -> RouteFn:
    """The target's own post-attention norm, router and top-k, applied to any hidden state."""
    layers = [layer for layer in model.layers if isinstance(layer.mlp, MoEBlock)]

    def route(moe_layer: int, h: torch.Tensor) -> torch.Tensor:
        layer = layers[moe_layer]
        x = layer.mlp_norm(h.to(device=model.device, dtype=model.dtype))  # [T, H]
        return layer.mlp.routing(x, None).expert_ids  # [T, k]

    return route


class WorkerPrefetch:
    """Hands predictions to the PrefetchWorker without synchronising the compute stream.

    The expert ids stay on the device; a non-blocking copy to pinned host memory and an event
    recorded after it let the worker (not compute) wait for them (Algorithm 1, lines 7-8).
    `progress()` counts MoE layer runs started (the runner's clock). A task for MoE layer m is
    stale once the verify pass has started m, i.e. after at most `lead_runs` more drafting runs
    (0 for a dense draft; gamma * MoE layers bounds a self-draft) plus m + 1 verify runs.
    """

    def __init__(self, worker: PrefetchWorker, progress: Callable[[], int], lead_runs: int) -> None:
        self.worker, self.progress, self.lead_runs = worker, progress, lead_runs

    def submit(self, layer: int, experts: torch.Tensor) -> None:
        ready = None
        if experts.is_cuda:
            host = experts.to("cpu", non_blocking=True)  # [m]
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = experts.clone()  # [m] the caller may reuse its tensor
        self.worker.submit(PrefetchTask(layer, host, ready, self.progress() + self.lead_runs + layer + 1))


class CrossModelPredictor:
    def __init__(self, route: RouteFn, draft_to_target: tuple[tuple[int, ...], ...],
                 target_moe_layers: tuple[int, ...], sink: PrefetchSink) -> None:
        """draft_to_target[d]: target MoE layers predicted at drafting layer d (layer_map.layer_map)."""
        self.route, self.draft_to_target, self.sink = route, draft_to_target, sink
        self.moe_index = {layer: i for i, layer in enumerate(target_moe_layers)}
        self.predicted: dict[int, list[torch.Tensor]] = defaultdict(list)  # MoE layer -> [k] ids per drafted token
        self.needed: dict[int, list[torch.Tensor]] = defaultdict(list)  # MoE layer -> [T, k] ids of the verify pass

    def on_draft_attention(self, layer: int, h: torch.Tensor) -> None:
        """Drafting layer `layer` produced h [T, H]; only the last row is a token the verify pass will run."""
        for moe_layer in self.draft_to_target[layer]:
            experts = self.route(moe_layer, h[-1:])[0]  # [k]
            self.predicted[moe_layer].append(experts)
            self.sink.submit(moe_layer, experts)

    def on_verify_attention(self, layer: int, h: torch.Tensor) -> None:
        """Target layer `layer` in the verify pass, h [T, H]: record what it needs, for the accuracy counters."""
        moe_layer = self.moe_index.get(layer)
        if moe_layer in self.predicted:
            self.needed[moe_layer].append(self.route(moe_layer, h))  # [T, k]

    def finish_round(self, stats: SpecStats) -> None:
        """Fold this draft/verify round into the per-layer accuracy counters and start afresh."""
        for moe_layer, predicted in self.predicted.items():
            needed = self.needed.get(moe_layer, [])
            stats.record_prediction(moe_layer, _ids(predicted), _ids(needed))
        self.reset()

    def reset(self) -> None:
        self.predicted.clear()
        self.needed.clear()


def _ids(tensors: list[torch.Tensor]) -> set[int]:
    return set(torch.cat([t.reshape(-1) for t in tensors]).tolist()) if tensors else set()
