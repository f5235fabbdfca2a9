"""`quant_method: awq` checkpoints of `version: gemm` (AutoAWQ's, as the *-AWQ models publish
them), 4-bit with zero points: `X.qweight` [K, N / 8] int32 packs eight codes along N and
`X.qzeros` [G, N / 8] int32 eight zero points, both with output 8w + AWQ_ORDER[i] in nibble i of
word w (the order AWQ's GEMM kernel unpacks in registers); `X.scales` [G, N] fp16; zeros stored as z.
Other versions pack differently and are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.quantized_checkpoints.packed_int4 import PackedInt4Checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds output AWQ_ORDER[i] of its eight
UNPACK_ORDER = tuple(AWQ_ORDER.index(j) for j in range(8))  # output j is nibble UNPACK_ORDER[j]


@dataclass(frozen=True)
class AwqCheckpoint(PackedInt4Checkpoint):
    method: ClassVar[str] = "awq"

    @classmethod
    def from_settings(cls, settings: dict[str, Any]) -> AwqCheckpoint:
        group = cls.supported_group_size(settings)
        version = str(settings.get("version", "gemm"))
        if version.lower() != "gemm":
            raise ValueError(f"quantization_config.version {version!r} is not supported: awq checkpoints load "
                             f"packed for gemm")
        if not settings.get("zero_point", True):
            raise ValueError("quantization_config.zero_point false is not supported: awq checkpoints load with "
                             "zero points")
        return cls(group)

    def groups(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.unpacked(tensors, codes_dim=-1, order=UNPACK_ORDER)
