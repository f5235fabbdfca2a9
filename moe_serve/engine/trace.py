"""RoutingRecorder: `--record-routing FILE` writes every MoE layer's routing as JSONL.

One line per (token position, MoE layer), in the order the layers ran:
  step          index of the forward (lines of one step and layer form one layer run)
  pos, layer    token position (in its own sequence: a batched step has tokens of several), MoE layer index
  experts       the experts the token was routed to, probs: their router probabilities
  top_experts   the token's 2*top_k most probable experts, top_probs: their probabilities
                (what MRS scores see)
  next_experts  the next-layer predictor's per-token guess for layer + 1, next_probs: its
                probabilities (absent at the last layer, or when no router weights were given)
`python -m moe_serve.engine.replay FILE` replays it through the cache policies and the predictor.
"""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import torch

from moe_serve.engine.experts.routing import LayerRouting


class RoutingRecorder:
    """Observer of CachedExpertRunner; the engine calls begin_forward before every forward."""

    def __init__(self, path: str | Path, top_k: int) -> None:
        self.top_p = 2 * top_k
        self._file = open(path, "w", encoding="utf-8")
        self._step = -1
        self._positions: Sequence[int] = ()

    def begin_forward(self, positions: Sequence[int]) -> None:
        """The next forward's tokens are at these positions (one per token, in feeding order)."""
        self._step += 1
        self._positions = positions

    def on_layer(self, routing: LayerRouting, next_guess: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        probs = routing.router_probs.float()  # [T, E]
        top = probs.topk(min(self.top_p, probs.shape[-1]), dim=-1)  # [T, p]
        columns = {
            "experts": routing.expert_ids.tolist(),
            "probs": probs.gather(1, routing.expert_ids).tolist(),
            "top_experts": top.indices.tolist(),
            "top_probs": top.values.tolist(),
        }
        if next_guess is not None:
            columns["next_experts"] = next_guess[1].tolist()
            columns["next_probs"] = next_guess[0].float().tolist()
        for t in range(probs.shape[0]):
            line = {"step": self._step, "pos": self._positions[t], "layer": routing.layer}
            line.update((name, values[t]) for name, values in columns.items())
            self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> RoutingRecorder:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
