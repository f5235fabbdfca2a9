"""`quant_method: mxfp4` checkpoints (gpt-oss's layout): a quantized weight [N, K] is two uint8
tensors named after it, `X_blocks` [N, K / 32, 16] (two E2M1 codes per byte, low nibble first) and
`X_scales` [N, K / 32] (E8M0 exponents), with a leading [E] for fused expert tensors
(`mlp.experts.gate_up_proj_blocks` [E, 2I, H / 32, 16]). Routed experts keep both bit for bit
(experts/formats/mxfp4.py: a row of blocks is the format's row of data). gpt-oss quantizes nothing
else (modules_to_not_convert: attention, router, embeddings, head); another weight that arrives as
blocks and scales is dequantized.

The gpt-oss family itself is not loaded yet. Its gate_up_proj interleaves gate and up rows (gate
at even rows, up at odd ones) where ExpertLayout keeps gate rows first, so its rules will have to
split the rows of blocks and of scales apart (still bit for bit); its experts also have biases
and a clamped SwiGLU with (up + 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.base import ExpertFormat
from moe_serve.engine.experts.formats.mxfp4 import BLOCK, Mxfp4
from moe_serve.engine.quantized_checkpoints.base import CheckpointQuant


@dataclass(frozen=True)
class Mxfp4Checkpoint(CheckpointQuant):
    method: ClassVar[str] = "mxfp4"
    expert_format: ClassVar[str] = Mxfp4.name
    suffixes: ClassVar[dict[str, str]] = {"blocks": "_blocks", "scales": "_scales"}

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> Mxfp4Checkpoint:
        return cls()  # gpt-oss's settings name only the modules left unquantized, which arrive as float weights

    def expert_parts(self, tensors: dict[str, torch.Tensor], fmt: ExpertFormat) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, scales = tensors["blocks"], tensors["scales"]
        for role, tensor in (("blocks", blocks), ("scales", scales)):
            if tensor.dtype != torch.uint8:
                raise ValueError(f"{role} are {tensor.dtype}, expected torch.uint8")
        if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
            raise ValueError(f"blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not describe one "
                             f"weight: expected [..., N, K / {BLOCK}, {BLOCK // 2}] and [..., N, K / {BLOCK}]")
        return blocks.flatten(-2), scales  # [..., N, K / 2], [..., N, K / 32]

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        data, scales = self.expert_parts(tensors, Mxfp4())
        return Mxfp4().decode(data, scales, 2 * data.shape[-1], dtype)

    def describe(self) -> str:
        return f"mxfp4 (e2m1, e8m0 scale per {BLOCK} weights)"
