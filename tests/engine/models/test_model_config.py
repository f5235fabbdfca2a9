"""ModelConfig.from_hf: family quirks read from config.json."""
from __future__ import annotations

import math

import pytest
import torch

from moe_serve.engine.kv.paged_cache import PagedKVCache, kv_bytes_per_token
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.experts.routing import Router
from tests.tiny_checkpoints import tiny_hf_model


def _config(family: str, **overrides) -> ModelConfig:
    model = tiny_hf_model(family)
    hf = {**model.config.to_dict(), "architectures": [type(model).__name__], **overrides}
    return ModelConfig.from_hf(hf)


def test_unsupported_architecture_names_the_supported_ones() -> None:
    with pytest.raises(ValueError, match="unsupported architectures.*MixtralForCausalLM.*Qwen3MoeForCausalLM"):
        ModelConfig.from_hf({"architectures": ["GPT2LMHeadModel"], "num_hidden_layers": 2})


def test_qwen2_moe_mlp_only_layers_are_dense_and_moe_layers_renumbered() -> None:
    config = _config("qwen2_moe")
    assert config.moe_layers == (0, 2)
    assert [config.moe_index(i) for i in range(3)] == [0, None, 1]
    assert config.shared_expert_intermediate_size == 48 and not config.norm_topk_prob
    assert config.qkv_bias and not config.o_bias


def test_qwen3_moe_sparse_step_and_per_head_qk_norm() -> None:
    config = _config("qwen3_moe")
    assert config.moe_layers == (1, 3)
    assert config.qk_norm == "per_head" and config.norm_topk_prob and config.tie_word_embeddings


def test_mixtral_always_normalises_and_olmoe_norms_full_projections() -> None:
    assert _config("mixtral").norm_topk_prob
    olmoe = _config("olmoe")
    assert olmoe.qk_norm == "full" and olmoe.clip_qkv == 3.0 and olmoe.moe_intermediate_size == 32


def test_num_experts_is_read_under_either_key() -> None:
    hf = {**tiny_hf_model("olmoe").config.to_dict(), "architectures": ["OlmoeForCausalLM"]}
    hf.pop("num_local_experts", None)
    assert ModelConfig.from_hf({**hf, "num_experts": 8}).num_experts == 8
    hf.pop("num_experts")
    assert ModelConfig.from_hf({**hf, "num_local_experts": 8}).num_experts == 8


def test_sliding_windows_per_layer() -> None:
    assert _config("mistral").attention_windows == (6, 6, 6)
    assert _config("qwen2").attention_windows == (None, 5, 5)  # max_window_layers=1
    assert _config("qwen2", use_sliding_window=False).attention_windows == (None, None, None)
    assert _config("llama").attention_windows == (None, None, None)


def test_head_dim_and_eos_ids() -> None:
    assert _config("qwen3").head_dim == 24
    assert _config("mixtral", head_dim=None).head_dim == 16
    assert _config("llama", eos_token_id=[2, 5]).eos_token_ids == (2, 5)


def test_deepseek_latent_attention_routing_and_dense_first_layers() -> None:
    v2, v3 = _config("deepseek_v2"), _config("deepseek_v3")
    for config in (v2, v3):
        assert config.moe_layers == (1, 2) and config.intermediate_size == 96  # first_k_dense_replace = 1
        assert config.num_kv_heads == 1 and config.head_dim == 32 + 8 and config.rope_dim == 8
        assert config.values_are_keys and not config.shared_expert_gated
    assert v2.mla.q_lora_rank is None and v3.mla.q_lora_rank == 24 and v3.qkv_bias and v3.o_bias
    assert v2.router == Router("softmax", 4, 2, "max", False, 1.5) and not v2.norm_topk_prob
    assert v3.router == Router("sigmoid", 4, 2, "top2", True, 2.5) and v3.norm_topk_prob
    assert v2.shared_expert_intermediate_size == 2 * 16 and v3.shared_expert_intermediate_size == 16
    assert v2.attention_scale == pytest.approx(24 ** -0.5)
    mscale = 0.1 * math.log(4.0) + 1.0  # yarn's factor 4, mscale_all_dim 1: squared onto q.k
    assert v3.attention_scale == pytest.approx(24 ** -0.5 * mscale**2)
    assert v3.unrun_layers == 1 and v2.unrun_layers == 0
    assert _config("deepseek_v2", topk_method="greedy").router == Router(scaling=1.5)
    assert _config("deepseek_v3", first_k_dense_replace=0, moe_layer_freq=2).moe_layers == (0, 2)


@pytest.mark.parametrize(("family", "overrides", "message"), [
    ("deepseek_v2", {"norm_topk_prob": True}, "DeepSeek-V2 routing .*norm_topk_prob=True"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc'"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v3", {"n_group": 3}, "do not split into n_group=3"),
])
def test_deepseek_routing_it_does_not_serve_is_refused(family: str, overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(family, **overrides)


def test_latent_attention_cache_holds_one_row_a_token_and_layer() -> None:
    v3, olmoe = _config("deepseek_v3"), _config("olmoe")
    assert kv_bytes_per_token(v3, torch.float32) == 3 * 40 * 4  # layers x (latent + roped key) x fp32
    assert kv_bytes_per_token(olmoe, torch.float32) == 2 * 3 * 4 * 16 * 4
    paged = PagedKVCache.for_model(v3, 4, 8, device="cpu", dtype=torch.float32)
    assert paged.values is paged.keys and paged.nbytes == 4 * 8 * kv_bytes_per_token(v3, torch.float32)
    contiguous = KVCache.for_model(v3, 8, device="cpu", dtype=torch.float32)
    assert contiguous.values is contiguous.keys and contiguous.nbytes == 8 * kv_bytes_per_token(v3, torch.float32)


def test_glm4_moe_rotates_half_of_each_head_and_routes_as_deepseek_v3() -> None:
    config = _config("glm4_moe")
    assert config.head_dim == 16 and config.rope.partial_rotary_factor == 0.5 and config.rope_dim == 8
    assert config.router == Router("sigmoid", 2, 1, "top2", True, 1.8) and config.norm_topk_prob
    assert config.moe_layers == (1, 2) and config.unrun_layers == 1  # its MTP layer
    assert config.qk_norm == "per_head" and config.qkv_bias and not config.o_bias
    assert config.shared_expert_intermediate_size == 16 and not config.shared_expert_gated
    assert not config.values_are_keys


def test_minimax_m2_norms_whole_projections_and_reads_the_released_rotary_dim() -> None:
    config = _config("minimax_m2")
    assert config.qk_norm == "full" and config.rope_dim == 8 and config.head_dim == 16
    assert config.router == Router("sigmoid", correction_bias=True) and config.norm_topk_prob
    assert config.moe_layers == (0, 1, 2) and config.shared_expert_intermediate_size == 0
    released = dict(rope_parameters={"rope_type": "default", "rope_theta": 5e6}, rotary_dim=4)  # as its config.json
    assert _config("minimax_m2", **released).rope_dim == 4


def test_ernie4_5_moe_layers_interleaved_rope_and_softmax_routing_with_a_correction() -> None:
    config = _config("ernie4_5_moe")
    assert config.moe_layers == (1, 2) and config.rope_interleaved and config.rope_dim == config.head_dim
    assert config.router == Router(correction_bias=True) and config.norm_topk_prob
    assert config.shared_expert_intermediate_size == 32 and not config.shared_expert_gated
    assert _config("ernie4_5_moe", moe_layer_interval=2, moe_layer_start_index=0).moe_layers == (1,)
    with pytest.raises(ValueError, match="use_bias"):
        _config("ernie4_5_moe", use_bias=True)


def test_dots1_windows_follow_its_layer_types_over_deepseek_v3_moe() -> None:
    config = _config("dots1")
    assert config.attention_windows == (None, 5, None) and config.qk_norm == "per_head"
    assert config.router == Router("sigmoid", 2, 1, "top2", True, 1.4) and config.moe_layers == (1, 2)
    assert config.shared_expert_intermediate_size == 16 and not config.shared_expert_gated


def test_gpt_oss_sinks_biases_and_windows_on_every_other_layer() -> None:
    config = _config("gpt_oss")
    assert config.attention_sinks and config.router_logit_bias and config.expert_biases
    assert config.expert_activation.kind == "clamped_swiglu" and config.expert_activation.limit == 7.0
    assert config.attention_windows == (5, None, 5) and config.norm_topk_prob
    assert _config("gpt_oss", layer_types=None).attention_windows == (5, None, 5)  # transformers' default
    assert config.rope.rope_type == "yarn" and not config.rope.truncate
