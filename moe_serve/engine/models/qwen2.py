"""Qwen2: Llama with biases on q/k/v (not on o)."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.family import ATTENTION_RULES, DENSE_MLP_RULES, Family, layer_type_windows


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(
        intermediate_size=hf["intermediate_size"],
        qkv_bias=True,
        attention_windows=layer_type_windows(hf),
    )


QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), _fields, ATTENTION_RULES + DENSE_MLP_RULES)
