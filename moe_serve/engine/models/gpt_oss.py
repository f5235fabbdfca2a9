"""gpt-oss (GptOssForCausalLM): GQA attention with biases and a learned sink logit per query head
(a softmax column with no value), layers alternating a sliding window and full attention, yarn
rope; every layer MoE. Its router has a bias and softmaxes the top-k logits (the same weights as a
softmax over all experts renormalised over the top-k); its experts have biases and a clamped SwiGLU,
(up + 1) * gate * sigmoid(alpha * gate) with gate <= limit and |up| <= limit.

transformers holds the experts as [E, H, 2I] gate_up and [E, I, H] down (inputs by outputs), gate
and up columns alternating; the released checkpoints publish them in MXFP4
(quantized_checkpoints/mxfp4.py) as [E, 2I, ...] rows, gate and up rows alternating. The rules say
so (TensorRule.interleaved, in_by_out), and the loader puts both into our gate-then-up rows.
"""
from __future__ import annotations

from typing import Any

from moe_serve.engine.experts.activation import ExpertActivation
from moe_serve.engine.experts.routing import Router
from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    EXPERT_PREFIX,
    Family,
    TensorRule,
    all_layers,
    layer_name,
    num_experts,
    windows_by_layer_type,
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", True))
    return dict(
        qkv_bias=bias,
        o_bias=bias,
        attention_sinks=True,
        attention_windows=windows_by_layer_type({**hf, "layer_types": _layer_types(hf)}, hf.get("sliding_window")),
        num_experts=num_experts(hf),
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        norm_topk_prob=True,
        router=Router("softmax"),
        router_logit_bias=True,
        expert_activation=ExpertActivation("clamped_swiglu", float(hf.get("swiglu_alpha", 1.702)),
                                           float(hf.get("swiglu_limit", 7.0))),
        expert_biases=True,
        moe_layers=all_layers(hf),
    )


def _layer_types(hf: dict[str, Any]) -> list[str]:
    """config.json's layer_types, or where a config has none transformers' default for gpt-oss: the
    window on even layers."""
    return hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                     for i in range(hf["num_hidden_layers"])]


_EXPERTS = layer_name("mlp.experts.")
_RULES = ATTENTION_RULES + (
    TensorRule(layer_name("self_attn.sinks"), "layers.{L}.attn.sinks"),
    TensorRule(layer_name("mlp.router.weight"), "layers.{L}.mlp.router.weight"),
    TensorRule(layer_name("mlp.router.bias"), "layers.{L}.mlp.router.bias"),
    TensorRule(_EXPERTS + "gate_up_proj", EXPERT_PREFIX + "gate_up", interleaved=True, in_by_out=True),
    TensorRule(_EXPERTS + "gate_up_proj_bias", EXPERT_PREFIX + "gate_up_bias", interleaved=True),
    TensorRule(_EXPERTS + "down_proj", EXPERT_PREFIX + "down", in_by_out=True),
    TensorRule(_EXPERTS + "down_proj_bias", EXPERT_PREFIX + "down_bias"),
)

GPT_OSS = Family("gpt_oss", ("GptOssForCausalLM",), _fields, _RULES)
