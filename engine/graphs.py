"""CUDA graphs of the one-token decode forward.

A decode step of a small-active-parameter MoE is hundreds of tiny kernels; launching them from
Python costs more than running them. When every expert is resident (or the model is dense) the
step has no host decision left, so it is captured once per (attention span bucket, top-r) and
replayed. Offloaded steps stay eager: their copies depend on what the cache holds.
"""
from __future__ import annotations

import torch

from engine.kv_cache import KVCache

MIN_SPAN = 256


def span_bucket(length: int, max_len: int) -> int:
    """Smallest power-of-two span (>= MIN_SPAN, capped at max_len) holding `length` keys."""
    span = MIN_SPAN
    while span < length:
        span *= 2
    return min(span, max_len)


class GraphedDecode:
    def __init__(self, model: torch.nn.Module, kv: KVCache, count_token=None) -> None:
        """`count_token(moe_top_r)` books one replayed token in the expert counters (replays run no Python)."""
        self.model, self.kv = model, kv
        self.count_token = count_token
        device = model.device
        self.input_ids = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.positions = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int | None], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def forward(self, token: int, moe_top_r: int | None = None) -> torch.Tensor:
        """Logits [1, V] of `token` at position kv.length; advances kv.length by one."""
        pos = self.kv.length
        key = (span_bucket(pos + 1, self.kv.max_len), moe_top_r)
        self.input_ids.fill_(token)
        self.positions.fill_(pos)
        if key in self.graphs:
            graph, logits = self.graphs[key]
            graph.replay()
            if self.count_token is not None:
                self.count_token(moe_top_r)
        else:
            logits = self._capture(key)
        self.kv.length = pos + 1
        return logits

    def _capture(self, key: tuple[int, int | None]) -> torch.Tensor:
        """Run this token eagerly on a side stream (warm-up, counted as usual), then capture."""
        span, top_r = key
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.model.forward_static(self.input_ids, self.positions, span, self.kv, moe_top_r=top_r)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            captured = self.model.forward_static(self.input_ids, self.positions, span, self.kv, moe_top_r=top_r)
        self.graphs[key] = (graph, captured)
        return logits
