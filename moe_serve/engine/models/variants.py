"""The attention and routing variants a family may declare beyond the shared blocks' defaults:
plain data that config.json is read into (the families) and the blocks are built from."""
from __future__ import annotations

from dataclasses import dataclass

ROUTER_SCORINGS = ("softmax", "sigmoid")
GROUP_SCORES = ("max", "top2")


@dataclass(frozen=True)
class LatentAttention:
    """DeepSeek's multi-head latent attention (MLA): queries from q_lora_rank (None: straight from x),
    keys and values of every head from one shared latent of kv_lora_rank plus a roped key part
    of qk_rope_head_dim. What the KV cache holds per token is that latent and roped key, one head
    wide (models/blocks.py LatentAttentionLayer)."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleaved: bool  # the roped dims come in (x0, x1), (x2, x3) pairs, not in halves


@dataclass(frozen=True)
class Router:
    """How a token's experts are chosen and weighed beyond softmax -> top-k (-> renormalise):
    DeepSeek scores by sigmoid (V3) and picks only among the topk_groups best of `groups` expert
    groups, a group scored by its best expert (V2) or its best two (V3); V3 adds a per-expert
    correction bias to the scores it picks by (never to the weights); the weights are scaled."""

    scoring: str = "softmax"  # softmax | sigmoid
    groups: int = 1
    topk_groups: int = 1
    group_score: str = "max"  # max | top2
    correction_bias: bool = False
    scaling: float = 1.0  # routed_scaling_factor

    def __post_init__(self) -> None:
        if self.scoring not in ROUTER_SCORINGS:
            raise ValueError(f"router scoring {self.scoring!r} not in {ROUTER_SCORINGS}")
        if self.group_score not in GROUP_SCORES:
            raise ValueError(f"group score {self.group_score!r} not in {GROUP_SCORES}")
        if not 1 <= self.topk_groups <= self.groups:
            raise ValueError(f"topk_group={self.topk_groups} must be in 1..n_group={self.groups}")
