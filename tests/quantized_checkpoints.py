"""Tiny quantized checkpoints for tests/engine/quantized_checkpoints/: a tiny float checkpoint
re-written in a quantization method's published layout, next to the float checkpoint of the same
weights as the method's reference dequantization gives them.

    quantized, reference = quantized_pair(float_ckpt, tmp_path, {"quant_method": ...}, quantize)

`quantize(name, tensor)` is the test's own writer of the published layout: None leaves the tensor
as it is; otherwise it returns the tensors that replace it (by full name) and the weight those
decode to. Loading `quantized` must then compute what loading `reference` computes.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.loader import LoadedModel, load_model
from tests.tiny_checkpoints import AllResidentRunner

Quantize = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor] | None]


def quantized_pair(src: Path, dst: Path, quantization_config: dict[str, Any], quantize: Quantize) -> tuple[Path, Path]:
    """Write dst/quantized and dst/reference from the checkpoint at src; return both paths."""
    quantized, reference = dst / "quantized", dst / "reference"
    for path in (quantized, reference):
        shutil.copytree(src, path)
    tensors, quantized_tensors, reference_tensors = load_file(src / "model.safetensors"), {}, {}
    for name, tensor in tensors.items():
        written = quantize(name, tensor)
        if written is None:
            quantized_tensors[name] = reference_tensors[name] = tensor
        else:
            quantized_tensors.update(written[0])
            reference_tensors[name] = written[1].to(tensor.dtype)
    save_file(quantized_tensors, str(quantized / "model.safetensors"), metadata={"format": "pt"})
    save_file(reference_tensors, str(reference / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (quantized / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return quantized, reference


def load(path: Path, **kwargs: Any) -> LoadedModel:
    return load_model(path, runner_factory=AllResidentRunner.factory, progress=False, **kwargs)


def logits(loaded: LoadedModel, tokens: int = 12) -> torch.Tensor:
    kv = KVCache.for_model(loaded.config, 16, device="cpu", dtype=loaded.model.dtype)
    return loaded.model(torch.arange(3, 3 + tokens), 0, kv).float()


def assert_same_model(quantized: LoadedModel, reference: LoadedModel) -> None:
    """Every expert decodes to the reference's weights exactly, and the logits agree (fp32)."""
    got, want = quantized.store, reference.store
    for moe in range(quantized.config.num_moe_layers):  # each layer in its own layout
        for matrix in ("gate_up", "down"):
            torch.testing.assert_close(got.layouts[moe].weights(got.rows[moe], matrix),
                                       want.layouts[moe].weights(want.rows[moe], matrix), rtol=0, atol=0)
    torch.testing.assert_close(logits(quantized), logits(reference), rtol=1e-5, atol=1e-5)


def int4_groups(w: torch.Tensor, group_size: int, sym: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ's and AWQ's round-to-nearest 4-bit groups of w [N, K], written here from their description:
    codes [N, K] and zeros [N, G] (int64, 0..15), fp16 scales [N, G], and the weights (q - z) * s they
    decode to [N, K]. sym: z = 8, s = absmax / 7.5; asym: the group's range widened to hold 0,
    s = range / 15, z = round(-min / s)."""
    groups = w.float().unflatten(-1, (-1, group_size))  # [N, G, g]
    low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)  # [N, G]
    if sym:
        high = torch.maximum(high, -low)
        low = -high
    scales = ((high - low) / 15).to(torch.float16)
    scales = torch.where(scales > 0, scales, 1.0)
    zeros = torch.full_like(low, 8) if sym else (-low / scales.float()).round().clamp(0, 15)
    codes = ((groups / scales.float()[..., None]).round() + zeros[..., None]).clamp(0, 15)  # [N, G, g]
    dequantized = (codes - zeros[..., None]) * scales.float()[..., None]
    return codes.flatten(-2).long(), zeros.long(), scales, dequantized.flatten(-2)


def pack_int32(values: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """Values 0..15 -> int32 words of eight, `dim` eight times shorter: nibble i (bits 4i..4i+3) of word w
    holds value 8w + order[i] along dim, as GPTQ (order 0..7) and AWQ pack them."""
    eights = values.movedim(dim, -1).long().unflatten(-1, (-1, 8))[..., list(order)]  # [..., W, 8] by nibble
    words = (eights << (4 * torch.arange(8))).sum(-1)  # [..., W] as unsigned 32-bit values
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).movedim(-1, dim).contiguous()
