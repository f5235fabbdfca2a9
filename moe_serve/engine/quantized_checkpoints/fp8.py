"""`quant_method: fp8` checkpoints (transformers' fine-grained FP8: Qwen3-*-FP8, DeepSeek-V3/R1):
each quantized linear is `X.weight` in float8_e4m3fn plus `X.weight_scale_inv`, one fp32 multiplier
per weight_block_size tile. Routed experts keep both as they are (experts/formats/fp8_block.py);
other quantized weights are dequantized; modules_to_not_convert come as plain float weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.base import ExpertFormat
from moe_serve.engine.experts.formats.fp8_block import BLOCK, Fp8Block
from moe_serve.engine.quantized_checkpoints.base import CheckpointQuant


@dataclass(frozen=True)
class Fp8BlockCheckpoint(CheckpointQuant):
    method: ClassVar[str] = "fp8"
    expert_format: ClassVar[str] = Fp8Block.name
    suffixes: ClassVar[dict[str, str]] = {"weight": ".weight", "scale_inv": ".weight_scale_inv"}

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> Fp8BlockCheckpoint:
        block = settings.get("weight_block_size")
        if list(block or ()) != [BLOCK, BLOCK]:
            raise ValueError(f"quantization_config.weight_block_size {block!r} is not supported: fp8 checkpoints "
                             f"load with [{BLOCK}, {BLOCK}] blocks")
        if settings.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"quantization_config.fmt {settings['fmt']!r} is not supported: fp8 checkpoints load as e4m3")
        return cls()

    def expert_parts(self, tensors: dict[str, torch.Tensor], fmt: ExpertFormat) -> tuple[torch.Tensor, torch.Tensor]:
        weight, scales = tensors["weight"], tensors["scale_inv"]
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"weight is {weight.dtype}, expected torch.float8_e4m3fn")
        return weight.view(torch.uint8), scales.float()

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        data, scales = self.expert_parts(tensors, Fp8Block())
        return Fp8Block().decode(data, scales, data.shape[-1], dtype)

    def describe(self) -> str:
        return f"fp8 ({BLOCK}x{BLOCK} blocks)"
