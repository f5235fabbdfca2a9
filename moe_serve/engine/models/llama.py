"""Llama and Mistral: the plain dense decoder every other family starts from."""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.family import ATTENTION_RULES, DENSE_MLP_RULES, Family, uniform_windows


def _llama_fields(hf: dict[str, Any]) -> dict[str, Any]:
    bias = bool(hf.get("attention_bias", False))
    return dict(
        intermediate_size=hf["intermediate_size"],
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=bool(hf.get("mlp_bias", False)),
    )


def _mistral_fields(hf: dict[str, Any]) -> dict[str, Any]:
    # Mistral's attention has no biases; v0.1 slides a window over every layer
    return dict(intermediate_size=hf["intermediate_size"], attention_windows=uniform_windows(hf, hf.get("sliding_window")))


LLAMA = Family("llama", ("LlamaForCausalLM",), _llama_fields, ATTENTION_RULES + DENSE_MLP_RULES)
MISTRAL = Family("mistral", ("MistralForCausalLM",), _mistral_fields, ATTENTION_RULES + DENSE_MLP_RULES)
