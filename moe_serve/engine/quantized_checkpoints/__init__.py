"""Quantized checkpoints as they are published, by config.json's quantization_config.quant_method:
one file each, and its line in _REGISTRY.

A method says how its checkpoint stores one linear weight (which tensors, by name suffix), turns
a routed expert's tensors into rows of an expert format (experts/formats/) without requantizing,
and dequantizes every other quantized weight to the model's dtype at load. A method not listed is
refused at start-up by name.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_serve.engine.quantized_checkpoints.base import CheckpointQuant

_REGISTRY = {"fp8": "fp8:Fp8BlockCheckpoint", "mxfp4": "mxfp4:Mxfp4Checkpoint",
             "gptq": "gptq:GptqCheckpoint", "awq": "awq:AwqCheckpoint"}  # quant_method -> module:class
QUANT_METHODS = tuple(_REGISTRY)


def checkpoint_quant(hf: dict[str, Any]) -> CheckpointQuant | None:
    """The method a config.json's quantization_config names; None for an unquantized checkpoint.
    Raises ValueError naming an unsupported method or setting."""
    settings = hf.get("quantization_config")
    if not settings:
        return None
    method = settings.get("quant_method")
    if method not in _REGISTRY:
        raise ValueError(f"quantization_config.quant_method {method!r} is not supported; "
                         f"supported: {', '.join(QUANT_METHODS)}")
    module, cls = _REGISTRY[method].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls).from_settings(settings)
