"""dots.llm1 (Dots1ForCausalLM, rednote's 142B-A14B): Qwen3's attention (per-head q/k norm, sliding
windows on the layers typed sliding_attention) over DeepSeek-V3's MoE: dense first layers, sigmoid
routing with the correction bias among the best groups, shared experts added ungated."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.deepseek import v3_moe_fields
from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    DENSE_MLP_RULES,
    Family,
    shared_experts_moe_rules,
    windows_by_layer_type,
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(
        **v3_moe_fields(hf),
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm="per_head",
        attention_windows=windows_by_layer_type(hf, hf.get("sliding_window")),
    )


DOTS1 = Family("dots1", ("Dots1ForCausalLM",), _fields, ATTENTION_RULES + DENSE_MLP_RULES + shared_experts_moe_rules())
