"""OLMoE: RMSNorm over the full q and k projections (before splitting heads), optional clipping
of q/k/v, every layer MoE; `intermediate_size` is the expert width."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    QWEN_EXPERT_NAMES,
    Family,
    all_layers,
    expert_rules,
    num_experts,
    router_rule,
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="full",
        clip_qkv=hf.get("clip_qkv"),
        num_experts=num_experts(hf),
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=all_layers(hf),
    )


OLMOE = Family(
    "olmoe",
    ("OlmoeForCausalLM",),
    _fields,
    ATTENTION_RULES + (router_rule("mlp."),) + expert_rules("mlp.", QWEN_EXPERT_NAMES),
)
