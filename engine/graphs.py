"""CUDA graphs of the one-token decode forward.

A decode step of a small-active-parameter MoE is hundreds of tiny kernels; launching them from
Python costs more than running them. Each (attention span bucket, top-r) gets its own capture.

* Every expert resident (or a dense model): the step has no host decision left, so it is one graph.
* Experts offloaded: which experts to copy depends on the routing, which only the host's cache
  can act on. The step is captured piecewise instead: one graph per stretch between two MoE
  layers' expert calls (attention, norms, router, the previous layer's experts). Between two
  replays the runner reads the layer's routing (the one sync the eager path also has), makes
  its experts resident and writes their slot ids into a buffer the next graph reads.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.experts.runner import CachedExpertRunner, CapturedLayer
from engine.kv_cache import KVCache

MIN_SPAN = 256


def span_bucket(length: int, max_len: int) -> int:
    """Smallest power-of-two span (>= MIN_SPAN, capped at max_len) holding `length` keys."""
    span = MIN_SPAN
    while span < length:
        span *= 2
    return min(span, max_len)


@dataclass(frozen=True)
class _Captured:
    segments: list[torch.cuda.CUDAGraph]  # replayed in order; one more than `layers`
    layers: list[CapturedLayer]  # the MoE layer whose expert call ends segment i (piecewise only)
    logits: torch.Tensor  # [1, V], written by the last segment


class GraphedDecode:
    def __init__(self, model: torch.nn.Module, kv: KVCache, runner: CachedExpertRunner | None = None) -> None:
        """`runner`: the model's expert runner (None for a dense model)."""
        self.model, self.kv, self.runner = model, kv, runner
        self.piecewise = runner is not None and not runner.graph_safe
        if self.piecewise and not runner.replayable:
            raise ValueError("this expert runner makes per-layer host decisions a graph replay cannot")
        device = model.device
        self.input_ids = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.positions = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int | None], _Captured] = {}

    def forward(self, token: int, moe_top_r: int | None = None) -> torch.Tensor:
        """Logits [1, V] of `token` at position kv.length; advances kv.length by one."""
        pos = self.kv.length
        key = (span_bucket(pos + 1, self.kv.max_len), moe_top_r)
        self.input_ids.fill_(token)
        self.positions.fill_(pos)
        captured = self.graphs.get(key)
        if captured is None:
            logits = self._warm_up_and_capture(key)
        else:
            logits = self._replay(captured, moe_top_r)
        self.kv.length = pos + 1
        return logits

    @torch.inference_mode()  # the captured tensors are inference tensors: the host writes slot ids into them
    def _replay(self, captured: _Captured, top_r: int | None) -> torch.Tensor:
        for i, layer in enumerate(captured.layers):
            captured.segments[i].replay()
            self.runner.replay_layer(layer)
        captured.segments[-1].replay()
        if self.piecewise:
            self.runner.finish_replay()
        elif self.runner is not None:  # one graph, every expert resident: a replay runs no Python
            self.runner.count_replayed_token(top_r or self.model.config.top_k)
        return captured.logits

    def _warm_up_and_capture(self, key: tuple[int, int | None]) -> torch.Tensor:
        """Run this token eagerly on a side stream (warm-up, counted as usual), then capture."""
        span, top_r = key
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self.model.forward_static(self.input_ids, self.positions, span, self.kv, moe_top_r=top_r)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graphs[key] = self._capture(span, top_r)
        return logits

    def _capture(self, span: int, top_r: int | None) -> _Captured:
        segments = [torch.cuda.CUDAGraph()]

        def split() -> None:  # the runner ends a segment at each MoE layer's expert call
            segments[-1].capture_end()
            segments.append(torch.cuda.CUDAGraph())
            segments[-1].capture_begin(pool=self.pool, capture_error_mode="thread_local")

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            segments[0].capture_begin(pool=self.pool, capture_error_mode="thread_local")
            if self.piecewise:
                with self.runner.capturing(split) as layers:
                    logits = self.model.forward_static(self.input_ids, self.positions, span, self.kv, moe_top_r=top_r)
            else:
                layers = []
                logits = self.model.forward_static(self.input_ids, self.positions, span, self.kv, moe_top_r=top_r)
            segments[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return _Captured(segments, layers, logits)
