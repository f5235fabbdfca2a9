"""What a quantized checkpoint's method is: how it stores one linear weight [N, K] as tensors
whose names replace ".weight" by its suffixes, and what becomes of them at load.

The loader groups a weight's tensors by their shared stem before reading any data, then hands
each complete group to the method: routed experts go to `expert_parts` (the published codes and
scales re-laid into the expert format's rows, bit for bit where the format allows), every other
quantized weight to `dequantize`. A weight whose group holds only a float ".weight" (a module
the checkpoint left unquantized) loads as in an unquantized checkpoint.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.base import ExpertFormat


class CheckpointQuant(ABC):
    method: ClassVar[str]  # quantization_config.quant_method
    # role -> the suffix that replaces ".weight" in the weight's name (".weight" itself for the codes
    # of methods that keep that name); every role of a quantized weight must be present
    suffixes: ClassVar[dict[str, str]]

    @property
    @abstractmethod
    def expert_format(self) -> str:
        """The experts/formats/ name routed experts keep (an --expert-quant value): a class constant,
        or one the settings choose (GPTQ's and AWQ's group size)."""

    @classmethod
    @abstractmethod
    def from_settings(cls, settings: dict[str, Any]) -> CheckpointQuant:
        """From quantization_config; raises ValueError naming a setting it does not support."""

    @abstractmethod
    def expert_parts(self, tensors: dict[str, torch.Tensor], fmt: ExpertFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One routed expert weight's tensors by role (HF-shaped [N, K] weight, or [E, N, K] for all
        experts of a layer) -> (data, scales) in fmt's encoding, with the same leading dims."""

    @abstractmethod
    def dequantize(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """A quantized non-expert weight's tensors by role -> the weight [N, K] in dtype."""

    def describe(self) -> str:
        return self.method
