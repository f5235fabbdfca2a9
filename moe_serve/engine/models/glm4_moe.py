"""GLM-4.5 and GLM-4.5-Air (Glm4MoeForCausalLM): GQA attention with q/k/v biases, the first half of
each head's dims rotated (partial_rotary_factor 0.5), optional per-head q/k norm; the first
first_k_dense_replace layers dense, then DeepSeek-V3's MoE: sigmoid routing with the correction
bias among the best groups, shared experts added ungated. Its multi-token-prediction layers
(num_nextn_predict_layers) are not run: the loader skips them."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.deepseek import v3_moe_fields
from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    DENSE_MLP_RULES,
    Family,
    shared_experts_moe_rules,
    uniform_windows,
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(
        **v3_moe_fields(hf, norm_topk_prob=True),
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm="per_head" if hf.get("use_qk_norm") else "none",
        attention_windows=uniform_windows(hf, None),
    )


GLM4_MOE = Family("glm4_moe", ("Glm4MoeForCausalLM",), _fields,
                  ATTENTION_RULES + DENSE_MLP_RULES + shared_experts_moe_rules())
