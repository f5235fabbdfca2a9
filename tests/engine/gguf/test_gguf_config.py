"""A GGUF file's metadata gives the config its Hugging Face checkpoint's config.json gives, for every
supported architecture; what it cannot describe is refused by name."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGUFWriter

from moe_serve.engine.loader import read_config
from moe_serve.engine.models.rope import rope_frequencies
from tests.gguf_checkpoints import gguf_pair

LLAMA3 = dict(max_position_embeddings=2048, rope_parameters=dict(
    rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=2.0, high_freq_factor=16.0,
    original_max_position_embeddings=4096), head_dim=32)  # four of the 16 frequencies blended
FAMILIES = {"mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}, "olmoe": {}, "llama": LLAMA3,
            "qwen2": dict(use_sliding_window=False), "qwen3": {}, "deepseek_v2": {}, "deepseek_v3": {},
            "deepseek_v3-unsplit": dict(split_kv_b=False), "glm4_moe": dict(n_group=1, topk_group=1),
            "ernie4_5_moe": {}, "minimax_m2": {}, "dots1": dict(n_group=1, topk_group=1, layer_types=None),
            "gpt_oss": {}}


@pytest.mark.parametrize("family", FAMILIES)
def test_config_equals_the_hf_configs(tmp_path: Path, family: str) -> None:
    gguf_file, reference = gguf_pair(family.split("-")[0], tmp_path, **FAMILIES[family])
    got, want = read_config(gguf_file), read_config(reference)
    if want.rope.rope_type == "llama3":  # recovered from rope_freqs: low_freq_factor 1, the others scaled to it
        assert got.rope.rope_type == "llama3" and got.rope.factor == want.rope.factor
        torch.testing.assert_close(rope_frequencies(got.rope, got.head_dim)[0],
                                   rope_frequencies(want.rope, want.head_dim)[0], rtol=1e-5, atol=0)
        got = replace(got, rope=want.rope)
    # the files hold no multi-token-prediction layers (llama.cpp's converter drops DeepSeek-V3's)
    assert replace(got, published_expert_format="none", unrun_layers=want.unrun_layers) == want


def test_rope_freqs_that_do_not_determine_llama3_scaling_are_refused(tmp_path: Path) -> None:
    gguf_file, _ = gguf_pair("llama", tmp_path)  # the tiny llama's llama3 band holds one frequency of 8
    with pytest.raises(ValueError, match="rope_freqs has 1 frequencies between its kept and its scaled ones"):
        read_config(gguf_file)


def _metadata_only(path: Path, arch: str, **keys: Any) -> Path:
    """A GGUF of one dense layer's worth of metadata and no tensors: enough to be refused by."""
    writer = GGUFWriter(str(path), arch)
    values = dict(vocab_size=128, context_length=256, embedding_length=64, block_count=1, feed_forward_length=96,
                  **{"attention.head_count": 4, "attention.layer_norm_rms_epsilon": 1e-6}, **keys)
    for key, value in values.items():
        add = {int: writer.add_uint32, float: writer.add_float32, str: writer.add_string}[type(value)]
        add(f"{arch}.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("arch,keys,kind", [("gemma2", {}, "dense"), ("dbrx", {"expert_count": 8}, "MoE"),
                                            ("qwen2", {"expert_count": 8}, "MoE")])
def test_an_unsupported_architecture_is_refused_by_name(tmp_path: Path, arch: str, keys: dict, kind: str) -> None:
    gguf_file = _metadata_only(tmp_path / "model.gguf", arch, **keys)
    with pytest.raises(ValueError, match=f"GGUF architecture '{arch}' \\({kind}\\) is not supported; supported: dense "
                                         "llama, qwen2, qwen3, MoE llama, qwen2moe, qwen3moe, olmoe, deepseek2"):
        read_config(gguf_file)


def test_an_unsupported_rope_scaling_is_refused_by_name(tmp_path: Path) -> None:
    gguf_file = _metadata_only(tmp_path / "model.gguf", "qwen2", **{"rope.scaling.type": "longrope"})
    with pytest.raises(ValueError, match="GGUF rope scaling 'longrope' is not supported; supported: none, linear"):
        read_config(gguf_file)


def test_a_partial_rotation_is_refused_by_name(tmp_path: Path) -> None:
    gguf_file = _metadata_only(tmp_path / "model.gguf", "qwen2", **{"rope.dimension_count": 8})
    with pytest.raises(ValueError, match="GGUF rope.dimension_count 8 < the head's 16 .* not supported"):
        read_config(gguf_file)
