"""Predicting the verify pass's experts while drafting, and prefetching them (SP-MoE Algorithms 1 and 2).

At each drafting layer that the layer map ties to target MoE layers, the drafting model's
attention output h (the residual stream after attention, which the model hands to
`on_attention_output`) goes through the *target's* post-attention norm and router; the top-k
experts are what the verify pass will likely route this token to. The hook only does device work
into fixed buffers: it keeps each layer's h, and the last mapped drafting layer routes them all
in one batched matmul (StackedRouters), so a drafting forward replayed as a CUDA graph computes
the predictions too.

Each drafting forward's predictions are copied to pinned memory behind it (`collect`) and read
with its logits (`predictions`). The loop then launches the next
drafting forward and only after that hands the experts not handed over yet this round to the
cache (`prefetch`: Algorithm 1's tasks, issued by the compute thread itself as Algorithm 2's
worker would), so that host work overlaps the next draft token's compute instead of lengthening
the draft phase; the copies run on the prefetch stream meanwhile. The cache keeps resident
predictions from being evicted by later prefetches (Algorithm 1's cached-queue check, made a
guard: evicting one would only trade one copy the verify pass needs for another). A worker
thread doing the same work fought the compute thread for the GIL: on the GPU, with 12.6 MB
experts at half the experts cached and gamma 8, SP-MoE took 1.77 ms per token against plain
SD's 1.51 with it (bench/results/paired/paired-spmoe-thread-olmoe-50.md; the next-layer predictor had
taught the same lesson, moe_serve/engine/experts/predictor.py).
The verify pass's own routing, read back by the expert runner, scores the predictions.

The same predictor serves self-speculation: there the drafting model is the target itself running
r of its top-k experts and the layer map is the identity; the cache drops the experts the draft
just ran (resident), which leaves SS-MoE's incremental loads of the others.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
import torch.nn.functional as F

from moe_serve.engine.experts.routing import Router, choose_experts, expert_scores
from moe_serve.engine.models.blocks import CausalLM, MoEBlock
from moe_serve.engine.speculative.stats import SpecStats


class PrefetchSink(Protocol):
    def prefetch(self, keys: Sequence[tuple[int, int]]) -> None:
        """Start copying the non-resident (MoE layer, expert) `keys` ahead of need (ExpertCache.prefetch)."""
        ...


class StackedRouters:
    """The target's post-attention norms and routers of some MoE layers, stacked: one batched
    matmul routes one hidden state per layer. Per layer apart they were about eight kernels each,
    added to the ~190 kernels of 1-7 us that a drafted token already is on the H100."""

    def __init__(self, target: CausalLM, moe_layers: Sequence[int]) -> None:
        layers = [layer for layer in target.layers if isinstance(layer.mlp, MoEBlock)]
        picked = [layers[m] for m in moe_layers]
        self.eps = target.config.rms_norm_eps
        self.top_k = target.config.top_k
        self.router = target.config.router
        self.norm_weight = torch.stack([layer.mlp_norm.weight.detach() for layer in picked])  # [M, H]
        self.router_weight = torch.stack([layer.mlp.router.weight.detach() for layer in picked])  # [M, E, H]
        self.correction = (torch.stack([layer.mlp.router_bias.detach() for layer in picked])
                           if self.router.correction_bias else None)  # [M, E]
        self.logit_bias = (torch.stack([layer.mlp.router.bias.detach() for layer in picked])
                           if target.config.router_logit_bias else None)  # [M, E]

    def top_experts(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [M, H], row i for layer i -> each layer's top-k experts [M, k], chosen as its MoE block does."""
        x = F.rms_norm(hidden, hidden.shape[-1:], eps=self.eps) * self.norm_weight  # [M, H]
        logits = torch.bmm(self.router_weight, x.unsqueeze(-1)).squeeze(-1)  # [M, E]
        if self.logit_bias is not None:
            logits = logits + self.logit_bias
        if self.router == Router():  # softmax keeps the logits' order: spare its launches
            return logits.topk(self.top_k, dim=-1).indices  # [M, k]
        return choose_experts(expert_scores(logits, self.router), self.top_k, self.router, self.correction)


class CrossModelPredictor:
    def __init__(self, target: CausalLM, draft_to_target: tuple[tuple[int, ...], ...], sink: PrefetchSink) -> None:
        """draft_to_target[d]: target MoE layers predicted at drafting layer d (layer_map.layer_map)."""
        self.draft_to_target, self.sink = draft_to_target, sink
        self.runner = target.runner
        self._layers = sorted({m for layers in draft_to_target for m in layers})  # MoE layers, one row each
        self.routers = StackedRouters(target, self._layers)
        row = {moe_layer: i for i, moe_layer in enumerate(self._layers)}
        self._rows = [torch.tensor([row[m] for m in layers], dtype=torch.long, device=target.device)
                      for layers in draft_to_target]  # [draft layer] -> rows it fills
        self._last_draft_layer = max((d for d, layers in enumerate(draft_to_target) if layers), default=-1)
        # fixed addresses a graph writes: each predicted layer's input, then the latest drafted token's top-k
        self._hidden = torch.zeros(len(self._layers), target.config.hidden_size, dtype=target.dtype,
                                   device=target.device)  # [M, H]
        self._latest = torch.zeros(len(self._layers), target.config.top_k, dtype=torch.long,
                                   device=target.device)  # [M, k]
        # on CUDA the predictions travel to pinned memory behind each drafting forward (`collect`)
        on_cuda = self._latest.is_cuda
        self._host = torch.zeros(self._latest.shape, dtype=torch.long, pin_memory=on_cuda)  # [M, k]
        self._copied = torch.cuda.Event() if on_cuda else None
        # (MoE layer, expert) predicted this round: each is prefetched once, and scored after the verify pass
        self._predicted: set[tuple[int, int]] = set()
        self.needed: dict[int, set[int]] = {}  # MoE layer -> experts the verify pass ran

    def on_draft_attention(self, layer: int, h: torch.Tensor) -> None:
        """Drafting layer `layer` produced h [T, H]; only the last row is a token the verify pass will run.
        Device work only (CUDA graphs capture it): the rows wait in a buffer and the last mapped
        layer routes them all at once; `predictions` reads the result."""
        rows = self._rows[layer]
        if len(rows):
            self._hidden.index_copy_(0, rows, h[-1:].to(self._hidden.dtype).expand(len(rows), -1))
        if layer == self._last_draft_layer:
            self._latest.copy_(self.routers.top_experts(self._hidden))

    def collect(self) -> None:
        """Right after launching a drafting forward: queue its predictions' copy to the host."""
        if self._copied is not None:
            self._host.copy_(self._latest, non_blocking=True)
            self._copied.record()

    def predictions(self) -> list[list[int]]:
        """The collected drafting forward's predictions [M][k] (a blocking read cost ~35 us a token)."""
        if self._copied is None:  # CPU: the forward already wrote them
            return self._latest.tolist()
        self._copied.synchronize()
        return self._host.tolist()

    def prefetch(self, predictions: list[list[int]]) -> None:
        """Hand the experts not handed over yet this round to the cache, in layer order, in one call."""
        fresh = [key for moe_layer, row in zip(self._layers, predictions) for key in ((moe_layer, e) for e in row)
                 if key not in self._predicted]
        if fresh:
            self._predicted.update(fresh)
            self.sink.prefetch(fresh)

    @contextmanager
    def verifying(self) -> Iterator[None]:
        """Around the verify pass: what its MoE layers ran is what the predictions are scored against."""
        with self.runner.recording() as used:
            yield
        self.needed = used

    def finish_round(self, stats: SpecStats) -> None:
        """Fold this draft/verify round into the per-layer accuracy counters and start afresh."""
        by_layer: dict[int, set[int]] = {}
        for moe_layer, expert in self._predicted:
            by_layer.setdefault(moe_layer, set()).add(expert)
        for moe_layer, predicted in by_layer.items():
            stats.record_prediction(moe_layer, predicted, self.needed.get(moe_layer, set()))
        self.reset()

    def reset(self) -> None:
        self._predicted.clear()
        self.needed = {}
