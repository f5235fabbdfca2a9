"""`quant_method: gptq` checkpoints (AutoGPTQ, GPTQModel: Qwen*-GPTQ-Int4 and the like), 4-bit:
`X.qweight` [K / 8, N] int32 packs eight codes along K, low nibble first; `X.qzeros` [G, N / 8]
int32 packs eight zero points along N the same way; `X.scales` [G, N] fp16; `X.g_idx` [K] the group
of each input. In `checkpoint_format: gptq` (v1, the default) a stored zero is z - 1 modulo 16 (the
kernels add 1 back and keep 4 bits); `gptq_v2` stores z. `sym` only changes which zeros the
quantizer chose, so both load alike. Act-order checkpoints, whose g_idx permutes the groups, are
refused: their groups are not runs of K, which int4-zp rows are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.quantized_checkpoints.packed_int4 import PackedInt4Checkpoint

ZERO_OFFSETS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what a stored zero is short of z


@dataclass(frozen=True)
class GptqCheckpoint(PackedInt4Checkpoint):
    zero_offset: int  # ZERO_OFFSETS[checkpoint_format]
    method: ClassVar[str] = "gptq"
    suffixes: ClassVar[dict[str, str]] = {**PackedInt4Checkpoint.suffixes, "g_idx": ".g_idx"}

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> GptqCheckpoint:
        group = cls.supported_group_size(settings)
        # GPTQModel writes `format` beside (or, older, instead of) transformers' `checkpoint_format`
        checkpoint_format = settings.get("checkpoint_format", settings.get("format", "gptq"))
        if checkpoint_format not in ZERO_OFFSETS:
            raise ValueError(f"quantization_config.checkpoint_format {checkpoint_format!r} is not supported; "
                             f"supported: {', '.join(ZERO_OFFSETS)}")
        if settings.get("pack_dtype", "int32") != "int32":
            raise ValueError(f"quantization_config.pack_dtype {settings['pack_dtype']!r} is not supported: gptq "
                             f"checkpoints load packed in int32")
        if settings.get("dynamic"):
            raise ValueError("quantization_config.dynamic (per-module bits and group sizes) is not supported")
        return cls(group, ZERO_OFFSETS[checkpoint_format])

    def groups(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        codes, zeros, scales = self.unpacked(tensors, codes_dim=-2)  # [..., N, K], [..., N, G], [..., N, G]
        g_idx, runs = tensors["g_idx"], torch.arange(codes.shape[-1]) // self.group_size  # [..., K], [K]
        if g_idx.shape != (*codes.shape[:-2], codes.shape[-1]) or not torch.equal(g_idx.long(), runs.expand_as(g_idx)):
            raise ValueError("g_idx is not k // group_size: act-order checkpoints (desc_act with permuted groups) "
                             "are not supported")
        return codes, (zeros + self.zero_offset) & 0xF, scales

    def describe(self) -> str:
        return f"{super().describe()}, {'v1' if self.zero_offset else 'v2'} zeros"
