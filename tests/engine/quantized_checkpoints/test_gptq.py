"""`quant_method: gptq` checkpoints (AutoGPTQ / GPTQModel layout) load as published: routed experts
keep every 4-bit code, zero point and fp16 scale (int4-zp rows), other quantized linears are
dequantized, the routers stay float; v1 zeros (stored z - 1) and v2 zeros, sym and asym groups all
compute what the reference dequantization of the same checkpoint computes. Unsupported settings
and act-order checkpoints are refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moe_serve.engine.loader import LoadError, read_config
from moe_serve.engine.quantized_checkpoints import checkpoint_quant
from moe_serve.engine.quantized_checkpoints.gptq import GptqCheckpoint
from tests.quantized_checkpoints import assert_same_model, int4_groups, load, pack_int32, quantized_pair
from tests.tiny_checkpoints import build_tiny_checkpoint

STORED_ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # v1 stores z - 1 (modulo 16, as its kernels read it)
# (checkpoint_format, sym, group_size)
VARIANTS = [("gptq", True, 128), ("gptq", False, 32), ("gptq_v2", False, 64), ("gptq_v2", True, 32)]


def settings(checkpoint_format: str, sym: bool, group_size: int) -> dict:
    return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": False, "sym": sym,
            "checkpoint_format": checkpoint_format, "pack_dtype": "int32"}


def gptq_layout(checkpoint_format: str, sym: bool, group_size: int, g_idx=None):
    """The published layout, written here from its description: every linear but the routers and the
    head as `qweight` [K / 8, N] (eight codes along K, low nibble first), `qzeros` [G, N / 8] (eight
    zeros along N), `scales` [G, N] fp16, `g_idx` [K] (k // group_size, unless given)."""
    def write(name: str, w: torch.Tensor):
        if not name.endswith("proj.weight"):
            return None
        codes, zeros, scales, dequantized = int4_groups(w, group_size, sym)  # [N, K], [N, G], [N, G], [N, K]
        stored_zeros = (zeros - STORED_ZERO_OFFSETS[checkpoint_format]) % 16
        stem, k = name.removesuffix(".weight"), w.shape[1]
        return {stem + ".qweight": pack_int32(codes.T, dim=0), stem + ".qzeros": pack_int32(stored_zeros.T, dim=1),
                stem + ".scales": scales.T.contiguous(),
                stem + ".g_idx": (torch.arange(k) // group_size if g_idx is None else g_idx(k)).int()}, dequantized
    return write


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory) -> Path:
    # every K (256 hidden, 128 heads x dims and intermediates) whole groups of 32, 64 and 128
    return build_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("gptq") / "float", hidden_size=256,
                                 head_dim=32, intermediate_size=128, moe_intermediate_size=128)


@pytest.fixture(scope="module", params=VARIANTS, ids=["-".join(map(str, v)) for v in VARIANTS])
def pair(request, float_checkpoint, tmp_path_factory) -> tuple[Path, Path, int]:
    """(quantized, reference, group_size) of one variant."""
    root = tmp_path_factory.mktemp("-".join(map(str, request.param)))
    variant = request.param
    return *quantized_pair(float_checkpoint, root, settings(*variant), gptq_layout(*variant)), variant[2]


def test_experts_keep_the_published_codes_and_the_model_matches_the_reference(pair) -> None:
    quantized_path, reference_path, group_size = pair
    quantized, reference = load(quantized_path), load(reference_path)
    assert quantized.store.layout.format.name == f"int4-zp-g{group_size}"
    published = load_file(quantized_path / "model.safetensors")
    dequantized = load_file(reference_path / "model.safetensors")
    stem = f"model.layers.{quantized.config.moe_layers[1]}.mlp.experts.3.down_proj"
    layout, row = quantized.store.layout, quantized.store.row(1, 3)
    assert torch.equal(layout.sections["down.scales"].view(row), published[stem + ".scales"].T)  # bit for bit
    assert torch.equal(layout.down(row), dequantized[stem + ".weight"])  # every code and zero kept
    assert_same_model(quantized, reference)


def test_the_memory_plan_counts_the_published_format(pair) -> None:
    config, group_size = read_config(pair[0]), pair[2]
    assert config.published_expert_format == f"int4-zp-g{group_size}"
    h, i = config.hidden_size, config.moe_intermediate_size
    published = 3 * h * i * (0.5 + 2.5 / group_size)  # half a byte a weight, 2.5 bytes a group
    assert published <= config.expert_layout(torch.bfloat16).nbytes <= published + 16 * (2 * i + h)  # + padding
    with pytest.raises(ValueError, match=f"experts are int4-zp-g{group_size}: --expert-quant int4 would quantize"):
        config.expert_layout(torch.bfloat16, "int4")


def test_v1_zeros_are_stored_one_short_modulo_16_and_v2_zeros_as_they_are() -> None:
    """Eight outputs, one group: codes 0, zeros 0..7 stored v1-style (z = 0 wraps to 15)."""
    zeros = torch.arange(8)
    tensors = {"codes": torch.zeros(4, 8, dtype=torch.int32), "scales": torch.ones(1, 8, dtype=torch.float16),
               "zeros": pack_int32(((zeros - 1) % 16)[None], dim=1), "g_idx": torch.zeros(32, dtype=torch.int32)}
    assert tensors["zeros"].item() == 0x6543210F
    v1, v2 = GptqCheckpoint(32, zero_offset=1), GptqCheckpoint(32, zero_offset=0)
    assert v1.groups(tensors)[1][:, 0].tolist() == zeros.tolist()
    assert v2.groups(tensors)[1][:, 0].tolist() == ((zeros - 1) % 16).tolist()
    assert torch.equal(v1.dequantize(tensors, torch.float32), -zeros[:, None].float().expand(8, 32))


def test_codes_unpack_low_nibble_first_along_k() -> None:
    tensors = {"codes": torch.full((4, 8), 0x76543210, dtype=torch.int32),  # nibble j = j
               "zeros": torch.zeros(1, 1, dtype=torch.int32), "scales": torch.ones(1, 8, dtype=torch.float16),
               "g_idx": torch.zeros(32, dtype=torch.int32)}
    codes, zeros, scales = GptqCheckpoint(32, zero_offset=0).groups(tensors)  # [N, K], [N, G], [N, G]
    assert codes.shape == (8, 32) and torch.equal(codes, (torch.arange(32) % 8).to(torch.uint8).expand(8, 32))
    assert zeros.shape == scales.shape == (8, 1)


@pytest.mark.parametrize("edit,message", [
    ({"bits": 8}, "quantization_config.bits 8 is not supported: gptq checkpoints load with 4 bits"),
    ({"group_size": 256}, "quantization_config.group_size 256 is not supported; supported: 32, 64, 128"),
    ({"group_size": -1}, "quantization_config.group_size -1 is not supported"),
    ({"checkpoint_format": "marlin"}, "quantization_config.checkpoint_format 'marlin' is not supported; "
                                      "supported: gptq, gptq_v2"),
    ({"pack_dtype": "int16"}, "quantization_config.pack_dtype 'int16' is not supported"),
    ({"dynamic": {r".*\.1\..*": {"bits": 8}}}, "quantization_config.dynamic"),
])
def test_unsupported_settings_are_refused_by_name(edit, message) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        checkpoint_quant({"quantization_config": {**settings("gptq", True, 128), **edit}})


def test_format_is_read_where_gptqmodel_writes_it() -> None:
    config = {**settings("gptq", True, 128), "format": "gptq_v2"}
    del config["checkpoint_format"]
    assert checkpoint_quant({"quantization_config": config}) == GptqCheckpoint(128, zero_offset=0)


def test_act_order_is_refused_by_name_and_desc_act_with_groups_in_order_loads(float_checkpoint, tmp_path) -> None:
    variant, desc_act = ("gptq", False, 32), {**settings("gptq", False, 32), "desc_act": True}
    in_order, reference = quantized_pair(float_checkpoint, tmp_path / "in_order", desc_act, gptq_layout(*variant))
    assert_same_model(load(in_order), load(reference))

    def shuffled(k: int) -> torch.Tensor:
        return torch.randperm(k, generator=torch.Generator().manual_seed(0)) // 32

    permuted, _ = quantized_pair(float_checkpoint, tmp_path / "permuted", desc_act, gptq_layout(*variant, shuffled))
    with pytest.raises(LoadError, match=r"tensor '.*_proj\.weight': g_idx is not k // group_size: act-order"):
        load(permuted)


def test_a_missing_qzeros_is_named(float_checkpoint, tmp_path) -> None:
    name = "model.layers.1.mlp.experts.2.up_proj.qzeros"
    write = gptq_layout("gptq", True, 64)

    def without_one_qzeros(tensor_name: str, w: torch.Tensor):
        written = write(tensor_name, w)
        if written is not None:
            written[0].pop(name, None)
        return written

    quantized, _ = quantized_pair(float_checkpoint, tmp_path, settings("gptq", True, 64), without_one_qzeros)
    with pytest.raises(LoadError, match=f"missing tensor '{name}' of a gptq-quantized weight"):
        load(quantized)
