"""`quant_method: awq` checkpoints (AutoAWQ's GEMM layout) load as published: routed experts keep
every 4-bit code, zero point and fp16 scale (int4-zp rows), other quantized linears (shared experts,
a dense MLP, attention with its biases) are dequantized, modules_to_not_convert stay float; the
model computes what the reference dequantization of the same checkpoint computes. Other versions
and settings are refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_serve.engine.loader import LoadError
from moe_serve.engine.quantized_checkpoints import checkpoint_quant
from moe_serve.engine.quantized_checkpoints.awq import AwqCheckpoint
from tests.quantized_checkpoints import assert_same_model, int4_groups, load, pack_int32, quantized_pair
from tests.tiny_checkpoints import build_tiny_checkpoint

AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output AWQ_PACK_ORDER[i] of its eight
NOT_CONVERTED = ("mlp.gate.", "shared_expert_gate.")  # as Qwen MoE AWQ checkpoints leave the routers


def settings(group_size: int) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": [m.rstrip(".") for m in NOT_CONVERTED]}


def awq_layout(group_size: int):
    """The published layout, written here from its description: every linear but the routers and the
    head as `qweight` [K, N / 8] and `qzeros` [G, N / 8] (eight values along N in AWQ's order) and
    `scales` [G, N] fp16, asymmetric groups (zero points as they are)."""
    def write(name: str, w: torch.Tensor):
        if not name.endswith("proj.weight") or any(m in name for m in NOT_CONVERTED):
            return None
        codes, zeros, scales, dequantized = int4_groups(w, group_size, sym=False)  # [N, K], [N, G], [N, G], [N, K]
        stem = name.removesuffix(".weight")
        return {stem + ".qweight": pack_int32(codes.T, dim=1, order=AWQ_PACK_ORDER),
                stem + ".qzeros": pack_int32(zeros.T, dim=1, order=AWQ_PACK_ORDER),
                stem + ".scales": scales.T.contiguous()}, dequantized
    return write


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    # qwen2_moe: attention biases, shared experts behind a gate, a dense MLP layer; every K whole groups
    return build_tiny_checkpoint("qwen2_moe", tmp_path_factory.mktemp("awq") / "float", hidden_size=256,
                                 intermediate_size=128, moe_intermediate_size=128, shared_expert_intermediate_size=128)


@pytest.fixture(scope="module", params=[128, 32])
def pair(request, float_checkpoint, tmp_path_factory) -> tuple[Path, Path, int]:
    """(quantized, reference, group_size)."""
    root = tmp_path_factory.mktemp(f"g{request.param}")
    return *quantized_pair(float_checkpoint, root, settings(request.param), awq_layout(request.param)), request.param


def test_experts_keep_the_published_codes_and_the_model_matches_the_reference(pair) -> None:
    quantized_path, reference_path, group_size = pair
    quantized, reference = load(quantized_path), load(reference_path)
    assert quantized.store.layout.format.name == f"int4-zp-g{group_size}"
    published = load_file(quantized_path / "model.safetensors")
    dequantized = load_file(reference_path / "model.safetensors")
    assert "model.layers.0.self_attn.q_proj.bias" in published and "model.layers.0.mlp.gate.weight" in published
    stem = f"model.layers.{quantized.config.moe_layers[1]}.mlp.experts.5.gate_proj"
    layout, row = quantized.store.layout, quantized.store.row(1, 5)
    i = quantized.config.moe_intermediate_size
    gate_scales = layout.sections["gate_up.scales"].view(row)[:i]  # gate rows first
    assert torch.equal(gate_scales, published[stem + ".scales"].T)  # bit for bit
    assert torch.equal(layout.gate_up(row)[:i], dequantized[stem + ".weight"])  # every code and zero kept
    assert_same_model(quantized, reference)


def test_codes_and_zeros_unpack_in_awq_order_along_n() -> None:
    word = 0x76543210  # nibble i = i: output j of the eight gets the nibble AWQ wrote it to
    tensors = {"codes": torch.full((32, 1), word, dtype=torch.int32),
               "zeros": torch.full((1, 1), word, dtype=torch.int32), "scales": torch.ones(1, 8, dtype=torch.float16)}
    codes, zeros, scales = AwqCheckpoint(32).groups(tensors)  # [N, K], [N, G], [N, G]
    by_output = [AWQ_PACK_ORDER.index(j) for j in range(8)]
    assert by_output == [0, 4, 1, 5, 2, 6, 3, 7]
    assert codes.shape == (8, 32)
    assert torch.equal(codes, torch.tensor(by_output, dtype=torch.uint8)[:, None].expand(8, 32))
    assert zeros[:, 0].tolist() == by_output and scales.shape == (8, 1)


@pytest.mark.parametrize("edit,message", [
    ({"version": "gemv"}, "quantization_config.version 'gemv' is not supported: awq checkpoints load packed for gemm"),
    ({"version": "exllama"}, "quantization_config.version 'exllama' is not supported"),
    ({"zero_point": False}, "quantization_config.zero_point false is not supported"),
    ({"bits": 8}, "quantization_config.bits 8 is not supported: awq checkpoints load with 4 bits"),
    ({"group_size": 16}, "quantization_config.group_size 16 is not supported; supported: 32, 64, 128"),
])
def test_unsupported_settings_are_refused_by_name(edit, message) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint_quant({"quantization_config": {**settings(128), **edit}})


def test_autoawq_s_upper_case_version_is_gemm() -> None:
    assert checkpoint_quant({"quantization_config": {**settings(64), "version": "GEMM"}}) == AwqCheckpoint(64)


def test_a_missing_qzeros_is_named(float_checkpoint, tmp_path) -> None:
    name = "model.layers.0.self_attn.o_proj.qzeros"
    write = awq_layout(128)

    def without_one_qzeros(tensor_name: str, w: torch.Tensor):
        written = write(tensor_name, w)
        if written is not None:
            written[0].pop(name, None)
        return written

    quantized, _ = quantized_pair(float_checkpoint, tmp_path, settings(128), without_one_qzeros)
    with pytest.raises(LoadError, match=f"missing tensor '{name}' of a awq-quantized weight"):
        load(quantized)
