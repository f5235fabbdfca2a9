"""CUDA graphs of short forwards: a decode token, a draft token, a verify span of gamma + 1.

A decode step of a small-active-parameter MoE is hundreds of tiny kernels; launching them from
Python costs more than running them. Each (attention span bucket, top-r, tokens, attention hook)
gets its own capture; spans longer than MAX_TOKENS (prefills) run eagerly.

* Every expert resident (or a dense model): the forward has no host decision left, so it is one graph.
* Experts offloaded: which experts to copy depends on the routing, which only the host's cache
  can act on. The forward is captured piecewise instead: one graph per stretch between two MoE
  layers' expert calls (attention, norms, router, the previous layer's experts). Between two
  replays the runner reads the layer's routing (the one sync the eager path also has), makes
  its experts resident and writes their slot ids into a buffer the next graph reads.

An attention hook (speculative decoding's expert predictor) is captured with the forward, so it
must only do device work into tensors it owns (see engine/spec/cross_model.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.experts.runner import CachedExpertRunner, CapturedLayer
from engine.kv_cache import KVCache
from engine.models.blocks import AttentionHook

MIN_SPAN = 256
MAX_TOKENS = 16  # verify spans reach gamma + 1; a prefill is too long to be worth a capture per length


def span_bucket(length: int, max_len: int) -> int:
    """Smallest power-of-two span (>= MIN_SPAN, capped at max_len) holding `length` keys."""
    span = MIN_SPAN
    while span < length:
        span *= 2
    return min(span, max_len)


@dataclass(frozen=True)
class _Key:
    span: int
    top_r: int | None
    tokens: int
    hook: AttentionHook | None


@dataclass(frozen=True)
class _Captured:
    inputs: torch.Tensor  # [2, T] token ids, then positions: written before each replay
    segments: list[torch.cuda.CUDAGraph]  # replayed in order; one more than `layers`
    layers: list[CapturedLayer]  # the MoE layer whose expert call ends segment i (piecewise only)
    logits: torch.Tensor  # [T, V], written by the last segment


class GraphedDecode:
    def __init__(self, model: torch.nn.Module, kv: KVCache, runner: CachedExpertRunner | None = None) -> None:
        """`runner`: the model's expert runner (None for a dense model)."""
        self.model, self.kv, self.runner = model, kv, runner
        self.piecewise = runner is not None and not runner.graph_safe
        if self.piecewise and not runner.replayable:
            raise ValueError("this expert runner makes per-layer host decisions a graph replay cannot")
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[_Key, _Captured] = {}
        # token ids and positions are written here, then copied to the replayed graph's inputs: a
        # fresh pinned tensor per forward cost ~30 us of host time before every draft token
        self._host_inputs = torch.zeros(2 * MAX_TOKENS, dtype=torch.long, pin_memory=True)  # [2 * MAX_TOKENS]
        self._host_view = self._host_inputs.numpy()
        self._inputs_sent = torch.cuda.Event()  # the last copy out of _host_inputs

    def accepts(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens can replay a graph (else it runs eagerly)."""
        return tokens <= MAX_TOKENS and (not self.piecewise or self.runner.can_replay(tokens))

    def forward(self, tokens: list[int], moe_top_r: int | None = None,
                on_attention_output: AttentionHook | None = None) -> torch.Tensor:
        """Logits [T, V] of `tokens` at positions kv.length..; advances kv.length by T."""
        pos, t = self.kv.length, len(tokens)
        key = _Key(span_bucket(pos + t, self.kv.max_len), moe_top_r, t, on_attention_output)
        self._inputs_sent.synchronize()  # long done (the previous forward's logits were read): no wait
        self._host_view[:t] = tokens
        self._host_view[t : 2 * t] = range(pos, pos + t)
        inputs = self._host_inputs[: 2 * t].view(2, t)  # [2, T] contiguous: ids, then positions
        captured = self.graphs.get(key)
        if captured is None:
            logits = self._warm_up_and_capture(key, inputs)
        else:
            captured.inputs.copy_(inputs, non_blocking=True)
            self._inputs_sent.record()
            logits = self._replay(captured, key)
        self.kv.length = pos + t
        return logits

    @torch.inference_mode()  # the captured tensors are inference tensors: the host writes slot ids into them
    def _replay(self, captured: _Captured, key: _Key) -> torch.Tensor:
        for i, layer in enumerate(captured.layers):
            captured.segments[i].replay()
            self.runner.replay_layer(layer)
        captured.segments[-1].replay()
        if self.piecewise:
            self.runner.finish_replay()
        elif self.runner is not None:  # one graph, every expert resident: a replay runs no Python
            self.runner.count_replayed_tokens(key.tokens, key.top_r or self.model.config.top_k)
        return captured.logits

    def _warm_up_and_capture(self, key: _Key, host_inputs: torch.Tensor) -> torch.Tensor:
        """Run these tokens eagerly on a side stream (warm-up, counted as usual), then capture."""
        inputs = host_inputs.to(self.model.device)  # [2, T], the capture's fixed input address
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = self._forward_static(inputs, key)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graphs[key] = self._capture(inputs, key)
        return logits

    def _forward_static(self, inputs: torch.Tensor, key: _Key) -> torch.Tensor:
        return self.model.forward_static(inputs[0], inputs[1], key.span, self.kv, moe_top_r=key.top_r,
                                         on_attention_output=key.hook)

    def _capture(self, inputs: torch.Tensor, key: _Key) -> _Captured:
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
                    logits = self._forward_static(inputs, key)
            else:
                layers = []
                logits = self._forward_static(inputs, key)
            segments[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return _Captured(inputs, segments, layers, logits)
