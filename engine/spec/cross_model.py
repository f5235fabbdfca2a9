"""Predicting the verify pass's experts while drafting (SP-MoE Algorithm 1).

At each drafting layer that the layer map ties to target MoE layers, the drafting model's
attention output h (the residual stream after attention, which the model hands to
`on_attention_output`) goes through the *target's* post-attention norm and router; the top-k
experts are what the verify pass will likely route this token to. The hook only writes them into
a fixed device buffer, so a drafting forward replayed as a CUDA graph computes them too; after
each drafted token they become prefetch tasks, so the copies overlap the rest of drafting (one
draft token of a small model is far shorter than one expert copy). The worker drops experts that
are already resident or in flight (Algorithm 1's cached-queue check, done where the cache lock
is held). The verify pass's own routing, read back by the expert runner, scores the predictions.

The same predictor serves self-speculation: there the drafting model is the target itself running
r of its top-k experts and the layer map is the identity; the worker drops the experts the draft
just ran (resident), which leaves SS-MoE's incremental loads of the others.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch

from engine.experts.prefetch import PrefetchTask, PrefetchWorker
from engine.models.blocks import CausalLM, MoEBlock
from engine.spec.stats import SpecStats

RouteFn = Callable[[int, torch.Tensor], torch.Tensor]  # (target MoE layer, h [T, H]) -> expert ids [T, k]


class PrefetchSink(Protocol):
    def submit(self, layers: Sequence[int], experts: torch.Tensor) -> None:
        """Queue experts [M, m] (int64, any device): row i, most important first, for target MoE
        layer layers[i]. One call per drafted token."""
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
    recorded after it let the worker (not compute) wait for them (Algorithm 1, lines 7-8): one
    copy and one event per drafted token, shared by its layers' tasks, since drafting steps are
    short and the compute thread launches them.
    `progress()` counts MoE layer runs started (the runner's clock). A task for MoE layer m is
    stale once the verify pass has started m, i.e. after at most `lead_runs` more drafting runs
    (0 for a dense draft; gamma * MoE layers bounds a self-draft) plus m + 1 verify runs.
    """

    def __init__(self, worker: PrefetchWorker, progress: Callable[[], int], lead_runs: int) -> None:
        self.worker, self.progress, self.lead_runs = worker, progress, lead_runs

    def submit(self, layers: Sequence[int], experts: torch.Tensor) -> None:
        ready = None
        if experts.is_cuda:
            host = experts.to("cpu", non_blocking=True)  # [M, m]
            ready = torch.cuda.Event()
            ready.record()
        else:
            host = experts.clone()  # [M, m] the caller may reuse its tensor
        now = self.progress() + self.lead_runs
        for layer, row in zip(layers, host, strict=True):
            self.worker.submit(PrefetchTask(layer, row, ready, now + layer + 1))


class CrossModelPredictor:
    def __init__(self, target: CausalLM, draft_to_target: tuple[tuple[int, ...], ...], sink: PrefetchSink) -> None:
        """draft_to_target[d]: target MoE layers predicted at drafting layer d (layer_map.layer_map)."""
        self.route, self.draft_to_target, self.sink = target_router(target), draft_to_target, sink
        self.runner = target.runner
        self._layers = sorted({m for layers in draft_to_target for m in layers})  # MoE layers, one row each
        self._row = {moe_layer: i for i, moe_layer in enumerate(self._layers)}
        # the latest drafted token's top-k per predicted MoE layer: a fixed address a graph writes
        self._latest = torch.zeros(len(self._layers), target.config.top_k, dtype=torch.long,
                                   device=target.device)  # [M, k]
        self.predicted: dict[int, list[torch.Tensor]] = defaultdict(list)  # MoE layer -> [k] ids per drafted token
        self.needed: dict[int, set[int]] = {}  # MoE layer -> experts the verify pass ran

    def on_draft_attention(self, layer: int, h: torch.Tensor) -> None:
        """Drafting layer `layer` produced h [T, H]; only the last row is a token the verify pass will run.
        Device work only (CUDA graphs capture it); after_draft_token hands the result on."""
        for moe_layer in self.draft_to_target[layer]:
            self._latest[self._row[moe_layer]].copy_(self.route(moe_layer, h[-1:])[0])

    def after_draft_token(self) -> None:
        """After each drafting forward: its predictions become prefetch tasks, in one hand-over."""
        latest = self._latest.clone()  # [M, k] the next drafting forward rewrites _latest
        for moe_layer, row in self._row.items():
            self.predicted[moe_layer].append(latest[row])
        self.sink.submit(self._layers, latest)

    @contextmanager
    def verifying(self) -> Iterator[None]:
        """Around the verify pass: what its MoE layers ran is what the predictions are scored against."""
        with self.runner.recording() as used:
            yield
        self.needed = used

    def finish_round(self, stats: SpecStats) -> None:
        """Fold this draft/verify round into the per-layer accuracy counters and start afresh."""
        for moe_layer, predicted in self.predicted.items():
            stats.record_prediction(moe_layer, _ids(predicted), self.needed.get(moe_layer, set()))
        self.reset()

    def reset(self) -> None:
        self.predicted.clear()
        self.needed = {}


def _ids(tensors: list[torch.Tensor]) -> set[int]:
    return set(torch.cat([t.reshape(-1) for t in tensors]).tolist()) if tensors else set()
