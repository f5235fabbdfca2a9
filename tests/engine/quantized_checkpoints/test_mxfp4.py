"""`quant_method: mxfp4` checkpoints (gpt-oss's tensor layout) load as published: routed experts keep
the `_blocks` and `_scales` bytes bit for bit, another weight written that way is dequantized, and
the model computes what the reference dequantization of the same checkpoint computes. Quantizing
a float checkpoint at load (--expert-quant mxfp4) writes the very bytes the layout publishes."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from moe_serve.engine.loader import LoadError
from tests.quantized_checkpoints import assert_same_model, load, quantized_pair
from tests.tiny_checkpoints import build_tiny_checkpoint

BLOCK = 32
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # by code; code | 8 is the negative
# as gpt-oss: its experts are the only quantized weights
SETTINGS = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.gate",
                                                                "model.embed_tokens", "lm_head"]}


def mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The published layout, written here from its description: w [..., N, K] -> blocks [..., N, K / 32, 16]
    (E2M1 codes, the even weight in the low nibble), scales [..., N, K / 32] (E8M0: 2^(e - 127)) and
    the weights they decode to. Per block the least 2^e that fits the absmax into ±6; each weight
    rounded to the nearest E2M1 value, ties to the even code. A ragged K is zero-padded to whole blocks."""
    blocks = F.pad(w.float(), (0, -w.shape[-1] % BLOCK)).unflatten(-1, (-1, BLOCK))  # [..., N, K / 32, 32]
    absmax = blocks.abs().amax(-1, keepdim=True).double()
    e = (absmax > 6 * 2.0 ** torch.arange(-126, 128)).sum(-1, keepdim=True) - 126  # powers of two too small, counted
    scaled = blocks / torch.exp2(e.float())
    step = torch.where(scaled.abs() < 2, 0.5, torch.where(scaled.abs() < 4, 1.0, 2.0))  # E2M1's spacing
    values = torch.round(scaled / step) * step  # half to even: the even multiple of a step is the even code
    codes = (values.abs()[..., None] == E2M1_MAGNITUDES).int().argmax(-1) | (scaled < 0).int() << 3
    packed = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)  # [..., N, K / 32, 16]
    return packed, (e + 127).squeeze(-1).to(torch.uint8), (values * torch.exp2(e.float())).flatten(-2)


def gpt_oss_layout(name: str, w: torch.Tensor):
    """Fused experts as gpt-oss names them (`mlp.experts.gate_up_proj` -> `..._blocks`, `..._scales`);
    the dense layers' MLP linears too, to be dequantized (`mlp.down_proj.weight` -> `mlp.down_proj_blocks`)."""
    if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        stem = name
    elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")):
        stem = name.removesuffix(".weight")
    else:
        return None
    blocks, scales, dequantized = mxfp4(w)
    return {stem + "_blocks": blocks, stem + "_scales": scales}, dequantized


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(float, quantized, reference) of one tiny qwen3_moe: MoE layers 1 and 3, dense layers 0 and 2."""
    root = tmp_path_factory.mktemp("mxfp4")
    src = build_tiny_checkpoint("qwen3_moe", root / "float", fused_experts=True, hidden_size=64,
                                moe_intermediate_size=64)  # K of gate_up and of down: two blocks
    return src, *quantized_pair(src, root, SETTINGS, gpt_oss_layout)


def test_experts_keep_the_published_bytes_and_the_model_matches_the_reference(checkpoints) -> None:
    _, quantized_path, reference_path = checkpoints
    quantized, reference = load(quantized_path), load(reference_path)
    layout = quantized.store.layout
    assert layout.format.name == "mxfp4"
    published = load_file(quantized_path / "model.safetensors")
    stem, expert = f"model.layers.{quantized.config.moe_layers[1]}.mlp.experts.gate_up_proj", 3
    row = quantized.store.row(1, expert)
    assert torch.equal(layout.sections["gate_up"].view(row), published[stem + "_blocks"][expert].flatten(-2))
    assert torch.equal(layout.sections["gate_up.scales"].view(row), published[stem + "_scales"][expert])
    assert_same_model(quantized, reference)


def test_other_weights_written_as_blocks_are_dequantized(checkpoints) -> None:
    _, quantized_path, reference_path = checkpoints
    quantized, reference = load(quantized_path).model.state_dict(), load(reference_path).model.state_dict()
    assert quantized.keys() == reference.keys()
    assert all(torch.equal(quantized[name], reference[name]) for name in quantized)
    unquantized = load(checkpoints[0]).model.state_dict()
    assert not torch.equal(quantized["layers.0.mlp.down.weight"], unquantized["layers.0.mlp.down.weight"])


def test_quantizing_at_load_writes_the_published_bytes(checkpoints) -> None:
    float_path, quantized_path, _ = checkpoints
    at_load, published = load(float_path, expert_quant="mxfp4").store, load(quantized_path).store
    for section in published.layout.sections.values():
        assert torch.equal(section.view(at_load.rows), section.view(published.rows))


def _quantized_with(tmp_path: Path, src: Path, edit) -> Path:
    """The quantized checkpoint of src with edit(name, tensors) applied to each weight's written tensors."""
    def write(name: str, w: torch.Tensor):
        written = gpt_oss_layout(name, w)
        if written is not None:
            edit(name, written[0])
        return written

    return quantized_pair(src, tmp_path, SETTINGS, write)[0]


def test_a_missing_scales_tensor_is_named(checkpoints, tmp_path) -> None:
    name = "model.layers.3.mlp.experts.down_proj_scales"
    path = _quantized_with(tmp_path, checkpoints[0], lambda _, tensors: tensors.pop(name, None))
    with pytest.raises(LoadError, match=f"missing tensor '{name}' of a mxfp4-quantized weight"):
        load(path)


def test_blocks_and_scales_that_disagree_are_named(checkpoints, tmp_path) -> None:
    name = "model.layers.1.mlp.experts.down_proj"

    def drop_a_block_of_scales(weight: str, tensors: dict[str, torch.Tensor]) -> None:
        if weight == name:
            tensors[name + "_scales"] = tensors[name + "_scales"][..., :1].contiguous()

    path = _quantized_with(tmp_path, checkpoints[0], drop_a_block_of_scales)
    with pytest.raises(LoadError, match=rf"tensor '{name}': blocks \(6, 64, 2, 16\) and scales \(6, 64, 1\) do not "
                                        "describe one weight"):
        load(path)


def test_k_of_ragged_blocks_is_refused_by_name(tmp_path) -> None:
    src = build_tiny_checkpoint("qwen3_moe", tmp_path / "float", fused_experts=True, hidden_size=64,
                                moe_intermediate_size=48)
    path = quantized_pair(src, tmp_path, SETTINGS, gpt_oss_layout)[0]  # down_proj [64, 48] padded to 64
    with pytest.raises(ValueError, match="mxfp4 experts need matrices of whole 1 x 32 blocks; one is 64 x 48"):
        load(path)


def gpt_oss_published(name: str, w: torch.Tensor):
    """gpt-oss's experts as released: transformers holds gate_up_proj [E, H, 2I] and down_proj [E, I, H]
    (inputs by outputs), the release their blocks by output rows, gate and up rows still alternating."""
    if not name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
        return None
    blocks, scales, dequantized = mxfp4(w.transpose(-1, -2))
    return {name + "_blocks": blocks, name + "_scales": scales}, dequantized.transpose(-1, -2)


def test_gpt_oss_experts_load_as_released(tmp_path) -> None:
    src = build_tiny_checkpoint("gpt_oss", tmp_path / "float")
    settings = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                    "model.layers.*.mlp.router",
                                                                    "model.embed_tokens", "lm_head"]}
    quantized_path, reference_path = quantized_pair(src, tmp_path, settings, gpt_oss_published)
    quantized, reference = load(quantized_path), load(reference_path)
    assert quantized.store.layout.format.name == "mxfp4" and quantized.store.layout.biases
    assert_same_model(quantized, reference)
