"""ERNIE-4.5 MoE (Ernie4_5_MoeForCausalLM: ERNIE-4.5-21B-A3B, -300B-A47B): GQA attention whose q and
k rotate adjacent pairs of dims (their rows reordered to halves at load); MoE layers every
moe_layer_interval-th from moe_layer_start_index to moe_layer_end_index, the others dense; routed
by softmax, picked with a correction bias (moe_statics, saved [1, E]) and weighed without it,
renormalised; shared experts added ungated. Biases (use_bias) would reach the LM head too, which
no released checkpoint has: such a config is refused."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.experts.routing import Router
from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    DENSE_MLP_RULES,
    Family,
    TensorRule,
    layer_name,
    shared_experts_moe_rules,
    uniform_windows,
)


def _moe_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    start, every = hf.get("moe_layer_start_index", 0), hf.get("moe_layer_interval", 1)
    end = hf.get("moe_layer_end_index", hf["num_hidden_layers"] - 1)
    end = hf["num_hidden_layers"] - 1 if end in (None, -1) else end
    return tuple(i for i in range(hf["num_hidden_layers"]) if (i + 1) % every == 0 and start <= i <= end)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("use_bias"):
        raise ValueError("ERNIE-4.5 with use_bias (an LM head bias) is not supported")
    experts, shared = hf["moe_num_experts"], hf.get("moe_num_shared_experts") or 0
    if isinstance(experts, list):
        raise ValueError("ERNIE-4.5 with several expert groups (its vision-language models) is not supported")
    return dict(
        intermediate_size=hf["intermediate_size"],
        rope_interleaved=True,
        attention_windows=uniform_windows(hf, None),
        num_experts=experts,
        top_k=hf["moe_k"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=True,
        shared_expert_intermediate_size=hf["moe_intermediate_size"] * shared,
        shared_expert_gated=False,
        router=Router(correction_bias=True),
        moe_layers=_moe_layers(hf),
    )


# the routers' correction bias lives in moe_statics (beside the gate on disk, inside it in transformers
# 5's memory); everything else as DeepSeek's MoE layers
ERNIE4_5_MOE = Family(
    "ernie4_5_moe",
    ("Ernie4_5_MoeForCausalLM",),
    _fields,
    ATTENTION_RULES + DENSE_MLP_RULES
    + tuple(rule for rule in shared_experts_moe_rules() if not rule.hf.endswith("e_score_correction_bias"))
    + tuple(TensorRule(layer_name(prefix + "moe_statics.e_score_correction_bias"), "layers.{L}.mlp.router_bias")
            for prefix in ("mlp.", "mlp.gate.")),
)
