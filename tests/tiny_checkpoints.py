"""Tiny random HF checkpoints of every supported family, built with transformers' own classes.

    from tests.tiny_checkpoints import MOE_FAMILIES, build_tiny_checkpoint, tiny_hf_model, AllResidentRunner
    path = build_tiny_checkpoint("mixtral", tmp_path / "mixtral")              # per-expert tensors, as HF saves
    path = build_tiny_checkpoint("mixtral", tmp_path / "fused", fused_experts=True)  # transformers-5 fused 3-D
    loaded = load_model(path, runner_factory=AllResidentRunner.factory, progress=False)

Each family exercises some quirk (GQA, tied embeddings, biases, qk-norm, shared experts, sparse
step / mlp_only_layers, sliding windows, scaled rope, partial rotation, latent attention, grouped routing,
attention sinks, expert biases and a clamped activation). Weights
are perturbed so that every norm and bias matters, and routers are scaled so routing probabilities
are far from uniform (top-k is then stable under float noise). The same (family, seed) always gives the same weights.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moe_serve.engine.experts.compute import accumulate_experts
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.experts.store import ExpertStore
from moe_serve.engine.models.config import ModelConfig

MOE_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe", "minimax_m2",
                "ernie4_5_moe", "dots1", "gpt_oss")
DENSE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_BASE: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=3,
    intermediate_size=96,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

# family -> (transformers config class name, overrides of _BASE)
_FAMILY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(
        attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=16),
    )),
    "mistral": ("MistralConfig", dict(num_key_value_heads=1, sliding_window=6)),
    "qwen2": ("Qwen2Config", dict(
        tie_word_embeddings=True, use_sliding_window=True, sliding_window=5, max_window_layers=1,
        rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    )),
    "qwen3": ("Qwen3Config", dict(
        head_dim=24, max_position_embeddings=128,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32),
    )),
    "mixtral": ("MixtralConfig", dict(intermediate_size=32, num_local_experts=6, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2, shared_expert_intermediate_size=48,
        mlp_only_layers=[1], norm_topk_prob=False,
    )),
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_hidden_layers=4, moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
        decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=True,
    )),
    "olmoe": ("OlmoeConfig", dict(
        num_key_value_heads=4, intermediate_size=32, num_experts=8, num_experts_per_tok=3, clip_qkv=3.0,
    )),
    # latent attention with queries straight from x, routing limited to the best 2 of 4 groups
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=16,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        routed_scaling_factor=1.5, norm_topk_prob=False,
    )),
    # latent attention with low-rank queries and attention bias, yarn's attention temperature on
    # q.k; sigmoid routing with the correction bias, groups scored by their best two, renormalised
    # and scaled weights
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=12, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
        attention_bias=True,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                             mscale=1.0, mscale_all_dim=1.0, beta_fast=32.0, beta_slow=1.0),
    )),
    # half of each head's dims rotated, q/k norm, attention biases; V3's routing in 2 groups, 1 shared expert
    # q/k norm over whole projections, a partial rotation; sigmoid routing with the correction bias
    "minimax_m2": ("MiniMaxM2Config", dict(
        head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    )),
    # adjacent pairs rotated, MoE from layer 1 with softmax routing and a correction bias, 2 shared experts
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", dict(
        moe_num_experts=8, moe_k=2, moe_num_shared_experts=2, moe_intermediate_size=16, moe_layer_start_index=1,
        moe_layer_end_index=2, tie_word_embeddings=True,
    )),
    # Qwen3's attention with a sliding window on the second layer over V3's MoE in 2 groups
    "dots1": ("Dots1Config", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.4, norm_topk_prob=True,
        sliding_window=5, layer_types=["full_attention", "sliding_attention", "full_attention"],
    )),
    # attention sinks and biases, a window on every other layer, yarn without truncation; a router
    # with a bias, experts with biases and the clamped SwiGLU (their gate/up scaled so the clamp binds)
    "gpt_oss": ("GptOssConfig", dict(
        head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, sliding_window=5,
        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=64,
                             beta_fast=32.0, beta_slow=1.0, truncate=False),
    )),
    "glm4_moe": ("Glm4MoeConfig", dict(
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.8, norm_topk_prob=True,
        use_qk_norm=True, attention_bias=True,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    )),
}


def tiny_hf_model(family: str, seed: int = 0, **sizes: Any) -> torch.nn.Module:
    """The transformers model (fp32, eager attention, eval mode) a tiny checkpoint is saved from;
    `sizes` override config fields (quantized formats need dims of whole blocks)."""
    import transformers

    if family not in _FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; known: {sorted(_FAMILY_CONFIGS)}")
    config_class, overrides = _FAMILY_CONFIGS[family]
    config = getattr(transformers, config_class)(**{**_BASE, **overrides, **sizes})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _perturb(model, config.hidden_size, seed)
    return model.eval()


def _perturb(model: torch.nn.Module, hidden: int, seed: int) -> None:
    """Make every norm weight and bias non-trivial and routers decisive."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")) and p.shape[0] > 1:  # a router [E, H]
                p.copy_(2.0 / math.sqrt(hidden) * torch.randn(p.shape, generator=gen))
            elif name.endswith("self_attn.sinks"):  # gpt-oss's: a sink comparable with the scores takes a share
                p.copy_(1.5 * torch.randn(p.shape, generator=gen))
            elif name.endswith("experts.gate_up_proj") and model.config.model_type == "gpt_oss":
                p.mul_(3.0)  # pre-activations past swiglu_limit, where the clamp binds
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's: it must change which experts are picked
                b.copy_(0.3 * torch.randn(b.shape, generator=gen))


def build_tiny_checkpoint(family: str, path: str | Path, *, fused_experts: bool = False, seed: int = 0,
                          **sizes: Any) -> Path:
    """Write config.json + model.safetensors of a tiny `family` model to path (created); return path.

    fused_experts=True writes the transformers-5 in-memory layout (mlp.experts.gate_up_proj
    [E, 2I, H] and down_proj [E, H, I]) instead of the per-expert tensors save_pretrained writes.
    """
    path = Path(path)
    model = tiny_hf_model(family, seed, **sizes)
    if not fused_experts:
        model.save_pretrained(path)
        return path
    if family not in MOE_FAMILIES:
        raise ValueError(f"{family} is dense: it has no experts to fuse")
    path.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]  # save_pretrained of the model would set it
    model.config.save_pretrained(path)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        del tensors["lm_head.weight"]  # safetensors refuses shared storage; save_pretrained drops it too
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


class AllResidentRunner:
    """TEST-ONLY ExpertRunner: every expert computed straight from its ExpertStore row, no cache."""

    def __init__(self, store: ExpertStore) -> None:
        self.store = store

    @classmethod
    def factory(cls, store: ExpertStore, config: ModelConfig) -> AllResidentRunner:
        return cls(store)

    def run(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        out = torch.zeros_like(x)  # [T, H]
        rows = {e: self.store.row(routing.layer, e) for e in routing.expert_ids.unique().tolist()}
        accumulate_experts(out, x, routing.expert_ids, routing.expert_weights, rows, self.store.layouts[routing.layer])
        return out
