"""MiniMax-M2 (MiniMaxM2ForCausalLM): GQA attention with RMSNorm over the whole q and k projections
and a partial rotation (released configs give it as `rotary_dim`, transformers as
partial_rotary_factor); every layer MoE, routed Mixtral-style (block_sparse_moe, experts w1/w3/w2)
by sigmoid scores picked with a correction bias, the weights renormalised; no shared experts."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.experts.routing import Router
from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    Family,
    TensorRule,
    all_layers,
    expert_rules,
    layer_name,
    num_experts,
    router_rule,
    uniform_windows,
)
from moe_serve.engine.models.rope import RopeConfig


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    rotary_dim = hf.get("rotary_dim")
    rope_hf = {**hf, "partial_rotary_factor": rotary_dim / head_dim} if rotary_dim else hf
    return dict(
        rope=RopeConfig.from_hf(rope_hf),
        qk_norm="full",
        attention_windows=uniform_windows(hf, None),
        num_experts=num_experts(hf),
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        norm_topk_prob=True,
        router=Router("sigmoid", correction_bias=True),
        moe_layers=all_layers(hf),
    )


# on disk the block is block_sparse_moe, in transformers 5's memory mlp (as Mixtral's)
_MOE_RULES = tuple(
    rule
    for prefix in ("block_sparse_moe.", "mlp.")
    for rule in (router_rule(prefix),
                 TensorRule(layer_name(prefix + "e_score_correction_bias"), "layers.{L}.mlp.router_bias"),
                 *expert_rules(prefix, ("w1", "w3", "w2")))
)

MINIMAX_M2 = Family("minimax_m2", ("MiniMaxM2ForCausalLM",), _fields, ATTENTION_RULES + _MOE_RULES)
