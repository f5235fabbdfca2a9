"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): GQA attention with q/k/v biases, the first half of
each head's dims rotated (partial_rotary_factor 0.5), optional per-head q/k norm; the first
first_k_dense_replace layers dense, then DeepSeek-V3's MoE: sigmoid routing with the correction
bias among the best groups, shared experts added ungated. Its multi-token-prediction layers
(num_nextn_predict_layers) are not run: the loader skips them."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.deepseek import moe_layers_after_dense, sigmoid_router
from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    DENSE_MLP_RULES,
    Family,
    shared_experts_moe_rules,
    uniform_windows,
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(
        intermediate_size=hf["intermediate_size"],
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm="per_head" if hf.get("use_qk_norm") else "none",
        attention_windows=uniform_windows(hf, None),
        num_experts=hf["n_routed_experts"],
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
        shared_expert_intermediate_size=hf["moe_intermediate_size"] * (hf.get("n_shared_experts") or 0),
        shared_expert_gated=False,
        router=sigmoid_router(hf),
        moe_layers=moe_layers_after_dense(hf),
        unrun_layers=int(hf.get("num_nextn_predict_layers") or 0),
    )


GLM4_MOE = Family("glm4_moe", ("Glm4MoeForCausalLM",), _fields,
                  ATTENTION_RULES + DENSE_MLP_RULES + shared_experts_moe_rules())
