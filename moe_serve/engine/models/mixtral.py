"""Mixtral: Mistral attention, every layer MoE, top-k weights always renormalised to sum to 1.

On disk the block is `block_sparse_moe` with experts w1 (gate), w3 (up), w2 (down); transformers 5
names the same module `mlp` and fuses the experts, so both spellings are accepted.
"""
from __future__ import annotations

from typing import Any

from moe_serve.engine.models.family import (
    ATTENTION_RULES,
    Family,
    all_layers,
    expert_rules,
    num_experts,
    router_rule,
    uniform_windows,
)


def _fields(hf: dict[str, Any]) -> dict[str, Any]:
    return dict(
        num_experts=num_experts(hf),
        top_k=hf["num_experts_per_tok"],
        moe_intermediate_size=hf["intermediate_size"],
        norm_topk_prob=True,
        moe_layers=all_layers(hf),
        attention_windows=uniform_windows(hf, hf.get("sliding_window")),
    )


_MOE_RULES = tuple(
    rule
    for prefix in ("block_sparse_moe.", "mlp.")
    for rule in (router_rule(prefix), *expert_rules(prefix, ("w1", "w3", "w2")))
)

MIXTRAL = Family("mixtral", ("MixtralForCausalLM",), _fields, ATTENTION_RULES + _MOE_RULES)
