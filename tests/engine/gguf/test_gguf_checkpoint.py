"""GGUF files load as the model they hold: for every supported architecture the logits equal those
of the Hugging Face checkpoint of the same weights as the gguf package dequantizes them (fp32),
routed experts keep the file's bytes, and expert types no format keeps are refused by name."""
from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, quants

from moe_serve.engine.config import ConfigError
from moe_serve.engine.experts.formats import expert_format
from moe_serve.engine.gguf.checkpoint import EXPERT_BLOCK_FORMATS, _mxfp4_rows
from moe_serve.engine.loader import read_config
from moe_serve.engine.preflight import check_model_dir
from tests.gguf_checkpoints import ARCHITECTURES, gguf_name, gguf_pair, llama_cpp_row_order
from tests.quantized_checkpoints import assert_same_model, load, logits
from tests.tiny_checkpoints import tiny_hf_model

BLOCKS_OF_256 = dict(hidden_size=256, moe_intermediate_size=256)
LLAMA3 = dict(max_position_embeddings=2048, rope_parameters=dict(
    rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=8.0,
    original_max_position_embeddings=1024))  # two of head_dim 16's frequencies in the blended band
# family, expert type, other matrices' type, sizes; each family brings its quirks (tiny_checkpoints.py)
CASES = [
    ("mixtral", "Q8_0", "Q8_0", {}),  # GGUF's llama with experts: q/k rows reordered
    ("mixtral", "Q4_0", "Q8_0", {}),  # the types of older files: symmetric 4-bit
    ("mixtral", "Q5_1", "Q8_0", {}),  # a min and a fifth bit
    ("qwen2_moe", "Q5_K", "Q8_0", BLOCKS_OF_256),  # shared expert and its gate, a dense layer, q/k/v biases
    ("qwen3_moe", "Q4_K", "Q8_0", BLOCKS_OF_256),  # dense layers between MoE ones, per-head q/k norm, tied
    ("qwen3_moe", "Q3_K", "Q8_0", BLOCKS_OF_256),  # the types of the largest MoE files: 3 and 2 bits
    ("qwen3_moe", "Q2_K", "Q8_0", BLOCKS_OF_256),
    ("qwen3_moe", "IQ4_XS", "Q8_0", BLOCKS_OF_256),  # non-linear levels
    ("olmoe", "Q6_K", "F16", dict(hidden_size=256, intermediate_size=256)),  # full q/k norm, clip_qkv
    # latent attention (kv_b split into attn_k_b / attn_v_b, as llama.cpp writes it now), shared experts,
    # a dense first layer, group-limited softmax routing
    ("deepseek_v2", "Q8_0", "Q8_0", dict(moe_intermediate_size=32)),
    # low-rank queries, yarn's mscale, sigmoid routing with exp_probs_b; and kv_b whole, as older files hold it
    ("deepseek_v3", "Q4_K", "Q8_0", BLOCKS_OF_256),
    ("deepseek_v3", "Q8_0", "Q8_0", dict(moe_intermediate_size=32, split_kv_b=False)),
    # a partial rotation, q/k norm, post_attention_norm, and an MTP layer counted in block_count (skipped)
    ("glm4_moe", "Q8_0", "Q8_0", dict(moe_intermediate_size=32, n_group=1, topk_group=1)),
    ("ernie4_5_moe", "Q8_0", "Q8_0", dict(moe_intermediate_size=32)),  # pair-rotating q/k rows, moe_statics
    ("minimax_m2", "Q8_0", "Q8_0", {}),  # whole-projection q/k norm, a partial rotation, sigmoid gating
    ("dots1", "Q8_0", "Q8_0", dict(moe_intermediate_size=32, n_group=1, topk_group=1, layer_types=None)),
    # sinks, biases (attention, router, experts), gate and up split from alternating rows, the clamped
    # SwiGLU, windows on even layers, yarn untruncated; as released (MXFP4) and as converted from bf16
    ("gpt_oss", "MXFP4", "Q8_0", {}),
    ("gpt_oss", "BF16", "F32", {}),
    ("llama", None, "Q8_0", LLAMA3),  # biases everywhere, tied embeddings, llama3 rope as rope_freqs
    ("qwen2", None, "Q8_0", dict(use_sliding_window=False)),  # linear rope (GGUF keeps no sliding window)
    ("qwen3", None, "F16", {}),  # yarn rope, head_dim != hidden / heads
]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gguf")


def _pair(root: Path, family: str, expert_type: str | None, weight_type: str, sizes: dict,
          **kwargs) -> tuple[Path, Path]:
    """The files of these settings, written once per module."""
    dst = root / "-".join([family, str(expert_type), weight_type, *(f"{name}={t}" for name, t in kwargs.get("types", {}).items())])
    if dst.exists():
        return dst / "model.gguf", dst / "reference"
    return gguf_pair(family, dst, expert_type=expert_type or "F32", weight_type=weight_type, **sizes, **kwargs)


@pytest.mark.parametrize("family,expert_type,weight_type,sizes", CASES,
                         ids=[f"{c[0]}-{c[1]}" + ("-kv_b" if c[3].get("split_kv_b") is False else "") for c in CASES])
def test_logits_equal_the_dequantized_reference(root: Path, family, expert_type, weight_type, sizes) -> None:
    gguf_file, reference_path = _pair(root, family, expert_type, weight_type, sizes)
    loaded, reference = load(gguf_file), load(reference_path)
    if expert_type is None:
        assert loaded.store is None
        torch.testing.assert_close(logits(loaded), logits(reference), rtol=1e-5, atol=1e-5)
    else:
        assert loaded.store.layout.format.name == EXPERT_BLOCK_FORMATS.get(expert_type, "none")
        assert_same_model(loaded, reference)


def test_expert_rows_hold_the_files_bytes(root: Path) -> None:
    gguf_file, _ = _pair(root, "qwen3_moe", "Q4_K", "Q8_0", BLOCKS_OF_256)
    _assert_rows_hold_the_files_bytes(load(gguf_file), gguf_file)


def test_mxfp4_blocks_are_re_laid_into_the_weights_llama_cpp_reads() -> None:
    """GGML's MXFP4 blocks as mxfp4.py's codes and scale bytes (gpt-oss's files): every code under every
    scale byte but 0 (2^-128, read as 0) and 255 (2^127, inf) decodes to what the gguf package's
    dequantization gives, bit for bit."""
    codes = torch.arange(32, dtype=torch.uint8) % 16
    qs = codes[:16] | codes[16:] << 4  # byte j: code j low, code j + 16 high
    blocks = torch.cat((torch.arange(1, 255, dtype=torch.uint8)[:, None], qs.expand(254, -1)), dim=-1)  # [254, 17]
    rows = blocks.reshape(2, -1)  # two rows of 127 blocks
    with np.errstate(over="ignore"):  # 12 x 2^126 (byte 254's largest code) overflows to inf, in both
        expected = quants.dequantize(rows.numpy(), GGMLQuantizationType.MXFP4)  # [2, 127 * 32]
    data, scales = _mxfp4_rows(rows)
    got = expert_format("mxfp4", torch.float32).decode(data, scales, expected.shape[-1], torch.float32)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


def _assert_rows_hold_the_files_bytes(loaded, gguf_file: Path, expert: int = 4) -> None:
    tensors = {t.name: t.data for t in GGUFReader(gguf_file).tensors}
    for moe, layer in enumerate(loaded.config.moe_layers):
        layout, row = loaded.store.layouts[moe], loaded.store.row(moe, expert)
        gate_up = np.concatenate([tensors[f"blk.{layer}.ffn_{part}_exps.weight"][expert] for part in ("gate", "up")])
        np.testing.assert_array_equal(layout.sections["gate_up"].view(row).numpy(), gate_up)
        np.testing.assert_array_equal(layout.sections["down"].view(row).numpy(),
                                      tensors[f"blk.{layer}.ffn_down_exps.weight"][expert])


def test_each_layer_keeps_its_own_expert_types(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Q4_K_M files give some layers' ffn_down_exps Q6_K: those layers get their own layout, every
    expert row holds the file's bytes, and the model is the dequantized reference's."""
    odd_one = "blk.3.ffn_down_exps.weight"
    gguf_file, reference_path = _pair(root, "qwen3_moe", "Q4_K", "Q8_0", BLOCKS_OF_256, types={odd_one: "Q6_K"})
    with caplog.at_level(logging.WARNING, logger="moe_serve.engine.gguf.checkpoint"):
        loaded = load(gguf_file)
    assert "re-encoded" not in caplog.text
    config, store = loaded.config, loaded.store
    assert config.published_layer_formats == tuple(("q4_k", "q6_k" if layer == 3 else "q4_k")
                                                   for layer in config.moe_layers)
    assert store.format_name == "q4_k+q6_k"
    odd = config.moe_layers.index(3)
    assert store.describe_formats() == (f"q4_k (layers {', '.join(str(m) for m in range(config.num_moe_layers) if m != odd)}), "
                                        f"q4_k with down q6_k (layers {odd})")
    # an expert slot holds the largest row; a row is its layer's own bytes, so a copy moves no padding
    sizes = {moe: store.layouts[moe].nbytes for moe in range(config.num_moe_layers)}
    assert store.row_nbytes == sizes[odd] > max(n for moe, n in sizes.items() if moe != odd)
    assert all(store.row(moe, 0).numel() == n for moe, n in sizes.items())
    _assert_rows_hold_the_files_bytes(loaded, gguf_file)
    assert_same_model(loaded, load(reference_path))


def test_gate_and_up_of_different_types_are_re_encoded_in_the_main_type(root: Path,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """A layer's gate and up share one matrix of the layout: an up of another type takes the type of
    most experts, and the log says so."""
    odd_one = "blk.3.ffn_up_exps.weight"
    gguf_file, reference_path = _pair(root, "qwen3_moe", "Q4_K", "Q8_0", BLOCKS_OF_256, types={odd_one: "Q6_K"})
    with caplog.at_level(logging.WARNING, logger="moe_serve.engine.gguf.checkpoint"):
        loaded = load(gguf_file)
    assert "expert tensors of Q6_K are re-encoded as Q4_K" in caplog.text
    assert loaded.config.published_layer_formats == () and loaded.store.layout.format.name == "q4_k"
    reference = load(reference_path)
    for moe, layer in enumerate(loaded.config.moe_layers):
        got, want = (m.store.layout.gate_up(m.store.rows[moe]) for m in (loaded, reference))
        if layer == 3:
            assert 0 < (got - want).norm() / want.norm() < 0.09  # Q6_K's weights, rounded again to Q4_K
        else:
            assert torch.equal(got, want)


def test_float_experts_load_plain_or_as_expert_quant_says(root: Path) -> None:
    gguf_file, reference_path = _pair(root, "mixtral", "F16", "F32", {})
    assert_same_model(load(gguf_file), load(reference_path))
    quantized = load(gguf_file, expert_quant="q8_0")
    assert quantized.store.layout.format.name == "q8_0"
    assert_same_model(quantized, load(reference_path, expert_quant="q8_0"))


def test_an_expert_type_no_format_keeps_is_refused_by_name(root: Path) -> None:
    gguf_file, _ = _pair(root, "qwen3_moe", "TQ2_0", "F32", BLOCKS_OF_256)
    with pytest.raises(ValueError, match="TQ2_0 experts are not supported .*supported: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, "
                                         "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS"):
        read_config(gguf_file)
    with pytest.raises(ConfigError, match=f"--model {gguf_file}: TQ2_0 experts are not supported"):
        check_model_dir(str(gguf_file), "--model")


def test_gguf_experts_are_not_quantized_again(root: Path) -> None:
    gguf_file, _ = _pair(root, "mixtral", "Q8_0", "Q8_0", {})
    config = read_config(gguf_file)
    assert config.published_expert_format == "q8_0"
    with pytest.raises(ValueError, match="experts are q8_0: --expert-quant int4 would quantize them again"):
        config.expert_layout(torch.float32, "int4")


def test_a_missing_gguf_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--model .*absent.gguf: no such GGUF file"):
        check_model_dir(str(tmp_path / "absent.gguf"), "--model")


def test_the_written_llama_row_order_is_the_one_llama_cpp_rotates_in_pairs() -> None:
    """llama.cpp rotates dims 2 i, 2 i + 1 of a head together, transformers dims i, D/2 + i: with the
    file's rows in llama_cpp_row_order, both compute the same rotated q. So the logits test above
    checks that the loader undoes exactly llama.cpp's converter."""
    heads, dim, hidden = 2, 8, 16
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(heads * dim, hidden, generator=gen), torch.randn(hidden, generator=gen)
    angle = torch.rand(dim // 2, generator=gen)
    cos, sin = angle.cos(), angle.sin()
    first, second = (w @ x).view(heads, 2, dim // 2).unbind(1)
    rotate_half = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)  # [heads, D]
    even, odd = (llama_cpp_row_order(w, heads) @ x).view(heads, dim // 2, 2).unbind(-1)
    pairs = torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=1)  # [heads, 2, D/2]
    torch.testing.assert_close(pairs.reshape(heads, dim), rotate_half)


# the tiny Qwen-MoE models have dense layers, which llama.cpp's qwen2moe and qwen3moe tensor lists lack
@pytest.mark.parametrize("family", sorted(set(ARCHITECTURES) - {"qwen2_moe", "qwen3_moe"}))
def test_the_test_files_tensor_names_are_llama_cpps(family: str) -> None:
    """The names these files are written with (tests/gguf_checkpoints.py) are those llama.cpp's converter
    gives each Hugging Face tensor: the gguf package's own map of its architecture."""
    arch = ARCHITECTURES[family]
    model = tiny_hf_model(family)
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
                                     model.config.num_hidden_layers)
    checked = 0
    for name in model.state_dict():
        if "experts." in name and "shared" not in name or name.endswith("kv_b_proj.weight"):
            continue  # stacked or split by the writer itself
        # the converter's own renaming before it maps (DeepSeek-V3, GLM-4.5; ERNIE's moe_statics, inside the
        # gate only in transformers' memory; gpt-oss's sinks)
        hf = name.replace("e_score_correction_bias", "e_score_correction.bias").replace(
            "mlp.gate.moe_statics", "mlp.moe_statics").replace("self_attn.sinks", "self_attn.sinks.weight")
        assert gguf_name(name, arch) == names.get_name(hf, try_suffixes=(".weight", ".bias")), name
        checked += 1
    assert checked > 10


def test_the_gpt_oss_files_tensors_are_those_llama_cpp_loads(root: Path) -> None:
    """Every tensor of the gpt-oss file, its split experts and their biases included, is one of the gguf
    package's gpt-oss tensors (llama.cpp's list for the architecture), and each of those is there."""
    gguf_file, _ = _pair(root, "gpt_oss", "MXFP4", "Q8_0", {})
    written = {t.name for t in GGUFReader(gguf_file).tensors}
    arch = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == "gpt-oss")
    layers = tiny_hf_model("gpt_oss").config.num_hidden_layers
    known = {gguf.TENSOR_NAMES[t].format(bid=layer) for t in gguf.MODEL_TENSORS[arch] for layer in range(layers)}
    assert {name.rsplit(".", 1)[0] for name in written} == known
    assert {name for name in written if name.endswith(".bias")} == {
        f"blk.{layer}.{t}.bias" for layer in range(layers)
        for t in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps",
                  "ffn_down_exps")}
