"""ModelConfig.from_hf: family quirks read from config.json."""
from __future__ import annotations

import pytest

from moe_serve.engine.models.config import ModelConfig
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
