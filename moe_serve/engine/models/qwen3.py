"""Qwen3: Llama with RMSNorm on each head of q and k before rotary."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.family import ATTENTION_RULES, DENSE_MLP_RULES, Family, layer_type_windows


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(
        intermediate_size=hf["intermediate_size"],
        qkv_bias=bias,
        o_bias=bias,
        qk_norm="per_head",
        attention_windows=layer_type_windows(hf),
    )


QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), _fields, ATTENTION_RULES + DENSE_MLP_RULES)
