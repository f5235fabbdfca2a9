"""The expert's gated activation: what turns an expert's gate and up projections into the input of
its down projection.

Most families use SwiGLU, silu(gate) * up. gpt-oss clamps both halves first and shifts up by one:
(clamp(up, -limit, limit) + 1) * gate * sigmoid(alpha * gate), gate first capped at limit
(transformers' GptOssExperts). The math is written once in torch (`ExpertActivation.__call__`, for
compute.py) and once in Triton (`gated_activation`, which the fused and grouped kernels call with
`kernel_args` as compile-time constants, so that silu's kernels compile to the instructions they
always had).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: only the torch path computes
    triton = None

ACTIVATION_KINDS = ("silu", "clamped_swiglu")


@dataclass(frozen=True)
class ExpertActivation:
    kind: str = "silu"  # silu | clamped_swiglu
    alpha: float = 1.702  # clamped_swiglu's sigmoid slope (gpt-oss's swiglu_alpha)
    limit: float = 7.0  # clamped_swiglu's bound on gate and |up| (gpt-oss's swiglu_limit)

    def __post_init__(self) -> None:
        if self.kind not in ACTIVATION_KINDS:
            raise ValueError(f"unknown expert activation {self.kind!r}; expected one of {ACTIVATION_KINDS}")

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up [..., I] -> the down projection's input [..., I], in their dtype."""
        if self.kind == "silu":
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        return (up + 1) * gate * torch.sigmoid(self.alpha * gate)

    @property
    def kernel_args(self) -> dict[str, Any]:
        """gated_activation's constants, as the gate/up kernels take them."""
        return {"CLAMPED_SWIGLU": self.kind == "clamped_swiglu", "ALPHA": self.alpha, "LIMIT": self.limit}


if triton is not None:

    @triton.jit
    def gated_activation(gate, up, CLAMPED_SWIGLU: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
        """ExpertActivation on fp32 tiles of gate and up (any equal shapes)."""
        if CLAMPED_SWIGLU:
            gate = tl.minimum(gate, LIMIT)
            up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
            act = (up + 1.0) * gate * tl.sigmoid(ALPHA * gate)
        else:
            act = gate * tl.sigmoid(gate) * up
        return act
