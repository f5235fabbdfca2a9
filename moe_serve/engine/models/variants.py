"""The attention variant a family may declare beyond the shared blocks' GQA attention: plain data
that config.json is read into (the families) and the blocks are built from. (Routing variants are
experts/routing.py's Router.)"""
from __future__ import annotations

from dataclasses import dataclass


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
    # the checkpoint's roped dims come in (x0, x1), (x2, x3) pairs, not in halves: the loader reorders
    # the rows making them (loader._latent_rope_halves)
    rope_interleaved: bool
