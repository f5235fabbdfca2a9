"""`quant_method: fp8` checkpoints (Qwen3-*-FP8 / DeepSeek-V3 layout) load as published: routed
experts keep the float8 codes and 128x128 `weight_scale_inv` blocks bit for bit, other quantized
linears are dequantized, modules_to_not_convert stay float; the model computes what the
reference dequantization of the same checkpoint computes."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from moe_serve.engine.loader import LoadError
from tests.quantized_checkpoints import assert_same_model, load, quantized_pair
from tests.tiny_checkpoints import build_tiny_checkpoint

BLOCK = 128
E4M3_MAX = 448.0
NOT_CONVERTED = ("lm_head", "mlp.gate")  # as Qwen3-*-FP8 leaves the head and the routers in bf16
SETTINGS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK],
            "modules_to_not_convert": list(NOT_CONVERTED)}


def fp8_blocks(name: str, w: torch.Tensor):
    """The published layout, written here from its description: per 128x128 tile, scale = absmax / 448,
    weight = e4m3(w / scale), weight_scale_inv = scale; the last tiles of a dim may be partial."""
    if not name.endswith("proj.weight") or any(m in name for m in NOT_CONVERTED):
        return None
    n, k = w.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    scale = torch.ones(rows, cols)
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK].float()
            scale[r, c] = tile.abs().max() / E4M3_MAX
            q[r * BLOCK:(r + 1) * BLOCK, c * BLOCK:(c + 1) * BLOCK] = (tile / scale[r, c]).to(torch.float8_e4m3fn)
    dequantized = q.float() * scale.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]
    stem = name.removesuffix(".weight")
    return {stem + ".weight": q, stem + ".weight_scale_inv": scale}, dequantized


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("fp8")
    # hidden 256 with 4 heads of 64: q/k/v/o have whole and partial tiles; experts of 128 rows
    src = build_tiny_checkpoint("qwen3_moe", root / "float", hidden_size=256, head_dim=48, moe_intermediate_size=128)
    return quantized_pair(src, root, SETTINGS, fp8_blocks)


def test_experts_keep_the_published_codes_and_the_model_matches_the_reference(pair) -> None:
    quantized_path, reference_path = pair
    quantized, reference = load(quantized_path), load(reference_path)
    assert quantized.store.layout.format.name == "fp8-block"
    published = load_file(quantized_path / "model.safetensors")
    layer, expert = quantized.config.moe_layers[1], 3
    stem = f"model.layers.{layer}.mlp.experts.{expert}.down_proj"
    row = quantized.store.row(1, expert)
    assert torch.equal(quantized.store.layout.sections["down"].view(row), published[stem + ".weight"].view(torch.uint8))
    assert torch.equal(quantized.store.layout.sections["down.scales"].view(row), published[stem + ".weight_scale_inv"])
    assert_same_model(quantized, reference)


def test_the_memory_plan_counts_the_published_format(pair) -> None:
    from moe_serve.engine.loader import read_config

    config = read_config(pair[0])
    assert config.published_expert_format == "fp8-block"
    h, i = config.hidden_size, config.moe_intermediate_size
    assert config.expert_layout(torch.bfloat16).nbytes >= 3 * h * i  # one byte per weight, plus block scales
    assert config.expert_layout(torch.bfloat16).nbytes < 3 * h * i * 1.1
    with pytest.raises(ValueError, match="experts are fp8-block: --expert-quant int4 would quantize them again"):
        config.expert_layout(torch.bfloat16, "int4")


def _rewrite(src: Path, dst: Path, edit) -> Path:
    dst.mkdir()
    for file in src.iterdir():
        (dst / file.name).write_bytes(file.read_bytes())
    tensors = load_file(dst / "model.safetensors")
    config = json.loads((dst / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_missing_scale_is_named(pair, tmp_path) -> None:
    name = "model.layers.1.mlp.experts.2.up_proj.weight_scale_inv"
    path = _rewrite(pair[0], tmp_path / "c", lambda t, c: t.pop(name))
    with pytest.raises(LoadError, match=f"missing tensor '{name}' of a fp8-quantized weight"):
        load(path)


def test_unsupported_methods_and_settings_are_refused_by_name(pair, tmp_path) -> None:
    path = _rewrite(pair[0], tmp_path / "a", lambda t, c: c["quantization_config"].update(quant_method="bitsandbytes"))
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported; supported: fp8"):
        load(path)
    path = _rewrite(pair[0], tmp_path / "b", lambda t, c: c["quantization_config"].update(weight_block_size=[64, 64]))
    with pytest.raises(ValueError, match=r"weight_block_size \[64, 64\] is not supported"):
        load(path)


def test_the_format_decodes_its_own_encoding_within_e4m3_rounding() -> None:
    from moe_serve.engine.experts.formats.fp8_block import Fp8Block

    w = torch.randn(256, 200) * torch.linspace(0.1, 3, 200)
    data, scales = Fp8Block().encode(w)
    assert scales.shape == (2, 2) and data.dtype == torch.uint8
    error = (Fp8Block().decode(data, scales, 200, torch.float32) - w).abs()
    assert (error <= 2 ** -4 * w.abs() + scales.max() * 2 ** -9).all()  # 3 mantissa bits; subnormals near 0
    assert F.mse_loss(Fp8Block().decode(data, scales, 200, torch.float32), w) < 1e-3 * w.pow(2).mean()
