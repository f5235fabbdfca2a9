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
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    window, types = hf.get("sliding_window"), hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
    return dict(
        **v3_moe_fields(hf),
        qkv_bias=bool(hf.get("attention_bias", False)),
        qk_norm="per_head",
        attention_windows=tuple(window if t == "sliding_attention" else None for t in types),
    )


DOTS1 = Family("dots1", ("Dots1ForCausalLM",), _fields, ATTENTION_RULES + DENSE_MLP_RULES + shared_experts_moe_rules())
