"""What GPTQ and AWQ checkpoints share: a linear weight [N, K] is stored as 4-bit codes and 4-bit zero
points packed eight to an int32 (`X.qweight`, `X.qzeros`) and one fp16 scale per group of
group_size weights along K (`X.scales`), w = (q - z) * s. The methods differ only in how the
nibbles are packed (gptq.py, awq.py: `groups`). Routed experts keep every code, zero and scale,
re-laid into int4-zp rows (experts/formats/int4_zp.py); other quantized weights are dequantized.
"""
from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.base import ExpertFormat
from moe_serve.engine.experts.formats.int4_zp import FORMATS_BY_GROUP_SIZE, dequantize
from moe_serve.engine.quantized_checkpoints.base import CheckpointQuant

NIBBLES = 8  # per int32 word
IN_ORDER = tuple(range(NIBBLES))


def unpack_int32(words: torch.Tensor, dim: int, order: Sequence[int] = IN_ORDER) -> torch.Tensor:
    """int32 words packing eight 4-bit values each (nibble i in bits 4i..4i+3) -> uint8 values, `dim`
    eight times longer: value 8w + j along dim is nibble order[j] of word w."""
    shifts = torch.tensor([4 * nibble for nibble in order], dtype=torch.int32)  # [8]
    last = words.movedim(dim, -1)  # [..., W]
    values = (last[..., None] >> shifts) & 0xF  # [..., W, 8]; >> is arithmetic, & drops the sign
    return values.flatten(-2).to(torch.uint8).movedim(-1, dim)


@dataclass(frozen=True)
class PackedInt4Checkpoint(CheckpointQuant):
    group_size: int
    suffixes: ClassVar[dict[str, str]] = {"codes": ".qweight", "zeros": ".qzeros", "scales": ".scales"}

    @staticmethod
    def supported_group_size(settings: dict[str, Any]) -> int:
        """settings' group size, checking they are 4-bit; ValueError naming an unsupported setting."""
        bits, group = settings.get("bits"), settings.get("group_size")
        if bits != 4:
            raise ValueError(f"quantization_config.bits {bits!r} is not supported: {settings['quant_method']} "
                             f"checkpoints load with 4 bits")
        if group not in FORMATS_BY_GROUP_SIZE:
            raise ValueError(f"quantization_config.group_size {group!r} is not supported; supported: "
                             f"{', '.join(map(str, FORMATS_BY_GROUP_SIZE))}")
        return group

    @property
    def expert_format(self) -> str:  # the format's name carries the group size (int4_zp.py says why)
        return FORMATS_BY_GROUP_SIZE[self.group_size].name

    @abstractmethod
    def groups(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A weight's tensors by role -> codes [..., N, K] and zeros [..., N, G] (uint8, 0..15), scales
        [..., N, G] fp16, G = K / group_size."""

    def unpacked(self, tensors: dict[str, torch.Tensor], codes_dim: int, order: Sequence[int] = IN_ORDER
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The codes (packed along codes_dim), zeros (packed along N) and scales, dtypes and shapes
        checked, as the N-major codes [..., N, K], zeros and scales [..., N, G] of `groups`."""
        for role, dtype in (("codes", torch.int32), ("zeros", torch.int32), ("scales", torch.float16)):
            if tensors[role].dtype != dtype:
                raise ValueError(f"{self.suffixes[role][1:]} is {tensors[role].dtype}, expected {dtype}")
        codes = unpack_int32(tensors["codes"], codes_dim, order)  # [..., K, N]
        zeros = unpack_int32(tensors["zeros"], -1, order)  # [..., G, N]
        k, n = codes.shape[-2:]
        if k % self.group_size:
            raise ValueError(f"qweight holds K = {k} inputs: not whole groups of {self.group_size}")
        expected = (*codes.shape[:-2], k // self.group_size, n)  # [..., G, N]
        for role, got in (("zeros", zeros), ("scales", tensors["scales"])):
            if tuple(got.shape) != expected:
                raise ValueError(f"{self.suffixes[role][1:]} holds {tuple(got.shape)} (groups, outputs), expected "
                                 f"{expected} for K = {k} in groups of {self.group_size}")
        return codes.transpose(-1, -2), zeros.transpose(-1, -2), tensors["scales"].transpose(-1, -2)

    def expert_parts(self, tensors: dict[str, torch.Tensor], fmt: ExpertFormat) -> tuple[torch.Tensor, torch.Tensor]:
        return fmt.pack(*self.groups(tensors))  # fmt: self.expert_format's (ModelConfig.expert_layout)

    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(*self.groups(tensors), dtype)

    def describe(self) -> str:
        return f"{self.method} (4-bit, group {self.group_size})"
