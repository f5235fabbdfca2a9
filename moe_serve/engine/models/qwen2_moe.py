"""Qwen2-MoE (Qwen1.5-MoE): Qwen2 attention, routed experts plus an always-on shared expert whose
output is scaled by sigmoid(shared_expert_gate(x)); some layers may stay dense."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    DENSE_MLP_RULES,
    QWEN_EXPERT_NAMES,
    Family,
    num_experts,
    TensorRule,
    expert_rules,
    layer_type_windows,
    router_rule,
    sparse_step_layers,
    swiglu_rules,
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(
        intermediate_size=hf["intermediate_size"],
        qkv_bias=bool(hf.get("qkv_bias", True)),
        attention_windows=layer_type_windows(hf),
        num_experts=num_experts(hf),
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=hf["shared_expert_intermediate_size"],
        moe_layers=sparse_step_layers(hf),
    )


_SHARED_RULES = swiglu_rules("model.layers.{L}.mlp.shared_expert.", "layers.{L}.mlp.shared.", QWEN_EXPERT_NAMES) + (
    TensorRule("model.layers.{L}.mlp.shared_expert_gate.weight", "layers.{L}.mlp.shared_gate.weight"),
)

QWEN2_MOE = Family(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    _fields,
    ATTENTION_RULES + DENSE_MLP_RULES + (router_rule("mlp."),) + expert_rules("mlp.", QWEN_EXPERT_NAMES) + _SHARED_RULES,
)
