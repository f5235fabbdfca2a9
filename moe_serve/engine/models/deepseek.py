"""DeepSeek-V2 and -V3 (and their derivatives: V2-Lite, V2.5, Moonlight): latent attention (MLA),
the first first_k_dense_replace layers dense, then routed experts beside always-on shared experts
added ungated. V2 routes by softmax (greedy, or limited to the topk_group best groups by each
group's best expert); V3 by sigmoid, picking with a per-expert correction bias among the best
groups by each group's best two, weighing without it. Both scale the weights by
routed_scaling_factor; V3 renormalises them first when norm_topk_prob.

The routed weights follow transformers' DeepseekV2/V3 modules, which the tests hold us to. V2's
original code renormalises when norm_topk_prob instead of scaling; no published V2 sets it, and
a config that does is refused rather than served one way or the other. V3's multi-token-prediction
layers (num_nextn_predict_layers, numbered after the last decoder layer) are not run: the loader
skips them.
"""
from __future__ import annotations

from typing import Any

from moe_serve.engine.experts.routing import Router
from moe_serve.engine.models.family import (
    DENSE_MLP_RULES,
    MODEL_RULES,
    Family,
    TensorRule,
    layer_name,
    shared_experts_moe_rules,
)
from moe_serve.engine.models.rope import RopeConfig, yarn_mscale
from moe_serve.engine.models.variants import LatentAttention


def _latent_attention(hf: dict[str, Any], v3: bool) -> dict[str, Any]:
    mla = LatentAttention(
        q_lora_rank=hf.get("q_lora_rank"),
        kv_lora_rank=hf["kv_lora_rank"],
        qk_nope_head_dim=hf["qk_nope_head_dim"],
        qk_rope_head_dim=hf["qk_rope_head_dim"],
        v_head_dim=hf["v_head_dim"],
        rope_interleaved=bool(hf.get("rope_interleave", True)) if v3 else True,  # V2 rotates complex pairs
    )
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    rope = RopeConfig.from_hf(hf)
    if rope.rope_type != "default" and rope.mscale_all_dim:  # yarn's attention temperature, on q.k
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    bias = bool(hf.get("attention_bias", False))
    # the cache holds one head of latent and roped key per token
    return dict(mla=mla, attention_scale=scale, num_kv_heads=1, head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
                qkv_bias=bias, o_bias=bias)


def _router(hf: dict[str, Any], v3: bool) -> Router:
    scale = float(hf.get("routed_scaling_factor") or 1.0)
    method = hf.get("topk_method", "noaux_tc" if v3 else "greedy")
    scoring = hf.get("scoring_func", "sigmoid" if v3 else "softmax")
    if v3:
        if (method, scoring) != ("noaux_tc", "sigmoid"):
            raise ValueError(f"DeepSeek-V3 routing topk_method={method!r} scoring_func={scoring!r} is not supported "
                             f"(noaux_tc over sigmoid is)")
        return sigmoid_router(hf)
    if scoring != "softmax" or hf.get("norm_topk_prob"):
        raise ValueError(f"DeepSeek-V2 routing with scoring_func={scoring!r}, norm_topk_prob="
                         f"{hf.get('norm_topk_prob')!r} is not supported (softmax without renormalising is)")
    if method == "greedy":
        return Router(scaling=scale)
    if method == "group_limited_greedy":
        return Router("softmax", hf["n_group"], hf["topk_group"], "max", False, scale)
    raise ValueError(f"DeepSeek-V2 topk_method {method!r} is not supported (greedy, group_limited_greedy are)")


def sigmoid_router(hf: dict[str, Any]) -> Router:
    """DeepSeek-V3's routing (GLM-4.5's too): sigmoid scores, picked with the correction bias among
    the topk_group best of n_group groups by their best two, the weights scaled."""
    return Router("sigmoid", hf.get("n_group") or 1, hf.get("topk_group") or 1, "top2", True,
                  float(hf.get("routed_scaling_factor") or 1.0))


def moe_layers_after_dense(hf: dict[str, Any]) -> tuple[int, ...]:
    """The layers from first_k_dense_replace on (every moe_layer_freq-th): the first ones are dense."""
    first, every = hf.get("first_k_dense_replace", 0), hf.get("moe_layer_freq", 1)
    return tuple(i for i in range(hf["num_hidden_layers"]) if i >= first and i % every == 0)


def v3_moe_fields(hf: dict[str, Any], norm_topk_prob: bool = False) -> dict[str, Any]:
    """DeepSeek-V3's MoE as a family's config.json gives it (GLM-4.5's and dots.llm1's too): dense
    first layers, routed experts by sigmoid_router beside ungated shared ones, MTP layers not run."""
    return dict(
        intermediate_size=hf["intermediate_size"],
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", norm_topk_prob)),
        shared_expert_intermediate_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        router=sigmoid_router(hf),
        moe_layers=moe_layers_after_dense(hf),
        unrun_layers=int(hf.get("num_nextn_predict_layers") or 0),
    )


def _fields(hf: dict[str, Any], v3: bool) -> dict[str, Any]:
    fields = {**v3_moe_fields(hf), **_latent_attention(hf, v3), "router": _router(hf, v3)}  # refuses the rest
    if not v3:  # V2 weighs without renormalising and has no MTP layers
        fields.update(norm_topk_prob=False, unrun_layers=0)
    return fields


def _attention_rules() -> tuple[TensorRule, ...]:
    names = {"q_proj": "q", "q_a_proj": "q_a", "q_b_proj": "q_b", "kv_a_proj_with_mqa": "kv_a", "kv_b_proj": "kv_b",
             "o_proj": "o"}
    return tuple(TensorRule(layer_name(f"self_attn.{hf}.{kind}"), f"layers.{{L}}.attn.{ours}.{kind}")
                 for hf, ours in names.items() for kind in ("weight", "bias")) + (
        TensorRule(layer_name("self_attn.q_a_layernorm.weight"), "layers.{L}.attn.q_a_norm.weight"),
        TensorRule(layer_name("self_attn.kv_a_layernorm.weight"), "layers.{L}.attn.kv_a_norm.weight"),
    )


_RULES = MODEL_RULES + _attention_rules() + DENSE_MLP_RULES + shared_experts_moe_rules()

DEEPSEEK_V2 = Family("deepseek_v2", ("DeepseekV2ForCausalLM",), lambda hf: _fields(hf, v3=False), _RULES)
DEEPSEEK_V3 = Family("deepseek_v3", ("DeepseekV3ForCausalLM",), lambda hf: _fields(hf, v3=True), _RULES)
