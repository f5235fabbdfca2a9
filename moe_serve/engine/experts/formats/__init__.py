"""Expert weight formats by --expert-quant name: one file each, and its line in _REGISTRY.

Names only at import (no torch): the CLI lists them for --help; a format's module is imported
when it is asked for.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from moe_serve.engine.experts.formats.mixes import MIXES

if TYPE_CHECKING:
    import torch

    from moe_serve.engine.experts.formats.base import ExpertFormat

_REGISTRY = {"none": "plain:Plain", "int8": "int8:Int8", "int4": "int4:Int4", "fp8": "fp8:Fp8",
             "fp8-block": "fp8_block:Fp8Block", "mxfp4": "mxfp4:Mxfp4",
             "int4-zp-g32": "int4_zp:Int4ZeroPointG32", "int4-zp-g64": "int4_zp:Int4ZeroPointG64",
             "int4-zp-g128": "int4_zp:Int4ZeroPointG128",
             "q8_0": "q8_0:Q8_0", "q4_0": "legacy_quants:Q4_0", "q4_1": "legacy_quants:Q4_1",
             "q5_0": "legacy_quants:Q5_0", "q5_1": "legacy_quants:Q5_1",
             "q2_k": "k_quants:Q2_K", "q3_k": "k_quants:Q3_K", "q4_k": "k_quants:Q4_K", "q5_k": "k_quants:Q5_K",
             "q6_k": "k_quants:Q6_K", "iq4_nl": "iq4:IQ4_NL", "iq4_xs": "iq4:IQ4_XS"}  # name -> module:class
FORMAT_NAMES = tuple(_REGISTRY)
# --expert-quant's values: a format, or a mix of formats by layer (mixes.py)
EXPERT_QUANT_NAMES = (*FORMAT_NAMES, *MIXES)


def expert_format(name: str, dtype: torch.dtype) -> ExpertFormat:
    """The format called `name` for a model computing in `dtype` ("none": the weights kept in dtype)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown expert format {name!r}; choose one of {', '.join(FORMAT_NAMES)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), cls).for_model(dtype)
