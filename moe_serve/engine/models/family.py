"""What a model family declares: its config.json quirks and how HF tensor names map onto ours.

A family file is pure data over these types; the shared blocks and the loader do the work.

Our parameter names (the targets of the map), with L the decoder layer:
  embed.weight, norm.weight, lm_head.weight
  layers.L.attn_norm.weight, layers.L.mlp_norm.weight
  layers.L.attn.qkv.{weight,bias} (q, k, v rows fused), layers.L.attn.o.{weight,bias}
  layers.L.attn.q_norm.weight, layers.L.attn.k_norm.weight, layers.L.attn.sinks (gpt-oss)
  latent attention (DeepSeek): layers.L.attn.q.weight or layers.L.attn.{q_a,q_b}.weight with
                layers.L.attn.q_a_norm.weight; layers.L.attn.kv_a.weight, layers.L.attn.kv_a_norm.weight,
                layers.L.attn.kv_b.weight, layers.L.attn.o.weight (q_a, kv_a and o with optional biases)
  dense layer:  layers.L.mlp.gate_up.{weight,bias} (gate, up rows fused), layers.L.mlp.down.{weight,bias}
  MoE layer:    layers.L.mlp.router.weight, layers.L.mlp.router.bias (gpt-oss's, on the logits),
                layers.L.mlp.router_bias (DeepSeek-V3's correction),
                layers.L.mlp.shared.gate_up.weight, layers.L.mlp.shared.down.weight,
                layers.L.mlp.shared_gate.weight
Routed experts go to the ExpertStore instead: targets "expert.gate", "expert.up", "expert.down"
(one expert, HF name has {E}) or "expert.gate_up", "expert.down" (all experts fused, no {E}), and
where experts have biases (gpt-oss) "expert.gate_up_bias", "expert.down_bias".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

EXPERT_PREFIX = "expert."


@dataclass(frozen=True)
class TensorRule:
    hf: str  # HF tensor name; {L} = decoder layer index, {E} = expert index
    ours: str  # our parameter name ({L} substituted) or an "expert.<part>" store target
    part: str | None = None  # rows of a fused parameter: q | k | v | gate | up
    # how a routed expert tensor differs from our rows (gpt-oss's): its gate and up rows (or a
    # bias's entries) alternate, and a float one is stored inputs by outputs ([.., K, N]; the
    # quantized tensors of the same name are [.., N, ...] rows already)
    interleaved: bool = False
    in_by_out: bool = False


@dataclass(frozen=True)
class Family:
    name: str
    architectures: tuple[str, ...]
    config_fields: Callable[[dict[str, Any]], dict[str, Any]]  # config.json -> family-specific ModelConfig fields
    rules: tuple[TensorRule, ...]


def layer_name(name: str) -> str:
    return "model.layers.{L}." + name


# the embedding, the head and each layer's two norms: every family's
MODEL_RULES = (
    TensorRule("model.embed_tokens.weight", "embed.weight"),
    TensorRule("model.norm.weight", "norm.weight"),
    TensorRule("lm_head.weight", "lm_head.weight"),
    TensorRule(layer_name("input_layernorm.weight"), "layers.{L}.attn_norm.weight"),
    TensorRule(layer_name("post_attention_layernorm.weight"), "layers.{L}.mlp_norm.weight"),
)


def _attention_rules() -> tuple[TensorRule, ...]:
    rules = [
        *MODEL_RULES,
        TensorRule(layer_name("self_attn.q_norm.weight"), "layers.{L}.attn.q_norm.weight"),
        TensorRule(layer_name("self_attn.k_norm.weight"), "layers.{L}.attn.k_norm.weight"),
    ]
    for kind in ("weight", "bias"):
        rules += [TensorRule(layer_name(f"self_attn.{p}_proj.{kind}"), f"layers.{{L}}.attn.qkv.{kind}", p)
                  for p in "qkv"]
        rules.append(TensorRule(layer_name(f"self_attn.o_proj.{kind}"), f"layers.{{L}}.attn.o.{kind}"))
    return tuple(rules)


def swiglu_rules(hf_prefix: str, ours_prefix: str, names: tuple[str, str, str]) -> tuple[TensorRule, ...]:
    """A SwiGLU MLP whose gate/up/down weights (and optional biases) are called `names` in HF."""
    gate, up, down = names
    rules = []
    for kind in ("weight", "bias"):
        rules += [
            TensorRule(f"{hf_prefix}{gate}.{kind}", f"{ours_prefix}gate_up.{kind}", "gate"),
            TensorRule(f"{hf_prefix}{up}.{kind}", f"{ours_prefix}gate_up.{kind}", "up"),
            TensorRule(f"{hf_prefix}{down}.{kind}", f"{ours_prefix}down.{kind}"),
        ]
    return tuple(rules)


def expert_rules(moe_prefix: str, names: tuple[str, str, str]) -> tuple[TensorRule, ...]:
    """Routed experts both as HF writes them (per expert) and as transformers 5 holds them (fused 3-D)."""
    gate, up, down = names
    experts = layer_name(moe_prefix + "experts.")
    return (
        TensorRule(experts + "{E}." + gate + ".weight", EXPERT_PREFIX + "gate"),
        TensorRule(experts + "{E}." + up + ".weight", EXPERT_PREFIX + "up"),
        TensorRule(experts + "{E}." + down + ".weight", EXPERT_PREFIX + "down"),
        TensorRule(experts + "gate_up_proj", EXPERT_PREFIX + "gate_up"),
        TensorRule(experts + "down_proj", EXPERT_PREFIX + "down"),
    )


def router_rule(moe_prefix: str) -> TensorRule:
    return TensorRule(layer_name(moe_prefix + "gate.weight"), "layers.{L}.mlp.router.weight")


def shared_experts_moe_rules() -> tuple[TensorRule, ...]:
    """DeepSeek-style MoE layers (GLM-4.5's too): the router and its correction bias, shared experts
    (added ungated), routed experts, under mlp."""
    correction = TensorRule(layer_name("mlp.gate.e_score_correction_bias"), "layers.{L}.mlp.router_bias")
    return ((router_rule("mlp."), correction)
            + swiglu_rules(layer_name("mlp.shared_experts."), "layers.{L}.mlp.shared.", QWEN_EXPERT_NAMES)
            + expert_rules("mlp.", QWEN_EXPERT_NAMES))


ATTENTION_RULES = _attention_rules()
DENSE_MLP_RULES = swiglu_rules(layer_name("mlp."), "layers.{L}.mlp.", ("gate_proj", "up_proj", "down_proj"))
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")


def uniform_windows(hf: dict[str, Any], window: int | None) -> tuple[int | None, ...]:
    """The same attention window (None: full causal) on every layer."""
    return (window or None,) * hf["num_hidden_layers"]


def layer_type_windows(hf: dict[str, Any]) -> tuple[int | None, ...]:
    """Qwen-style windows: only when use_sliding_window, and only on layers typed sliding_attention."""
    window = hf.get("sliding_window")
    if not (hf.get("use_sliding_window") and window):
        return uniform_windows(hf, None)
    if hf.get("layer_types") is None:
        raise ValueError("use_sliding_window without layer_types: re-save the config with transformers 5")
    return windows_by_layer_type(hf, window)


def windows_by_layer_type(hf: dict[str, Any], window: int | None) -> tuple[int | None, ...]:
    """`window` on the layers typed sliding_attention (every layer full where there are no types)."""
    types = hf.get("layer_types") or ["full_attention"] * hf["num_hidden_layers"]
    return tuple(window if t == "sliding_attention" else None for t in types)


def sparse_step_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    """Qwen-MoE: layer i is MoE unless listed in mlp_only_layers, and only every decoder_sparse_step-th."""
    step = hf.get("decoder_sparse_step", 1)
    dense = set(hf.get("mlp_only_layers") or ())
    return tuple(i for i in range(hf["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0)


def num_experts(hf: dict[str, Any]) -> int:
    """Versions of transformers disagree on the key (attribute_map aliases), so accept both."""
    count = hf.get("num_experts", hf.get("num_local_experts"))
    if count is None:
        raise ValueError("config.json has neither num_experts nor num_local_experts")
    return int(count)


def all_layers(hf: dict[str, Any]) -> tuple[int, ...]:
    return tuple(range(hf["num_hidden_layers"]))
