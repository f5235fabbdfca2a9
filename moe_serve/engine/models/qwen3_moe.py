"""Qwen3-MoE: Qwen3 attention (per-head q/k norm), routed experts, no shared expert."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    DENSE_MLP_RULES,
    QWEN_EXPERT_NAMES,
    Family,
    num_experts,
    expert_rules,
    router_rule,
    sparse_step_layers,
    uniform_windows,
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return dict(
        intermediate_size=hf["intermediate_size"],
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="per_head",
        attention_windows=uniform_windows(hf, window),
        num_experts=num_experts(hf),
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=sparse_step_layers(hf),
    )


QWEN3_MOE = Family(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    _fields,
    ATTENTION_RULES + DENSE_MLP_RULES + (router_rule("mlp."),) + expert_rules("mlp.", QWEN_EXPERT_NAMES),
)
