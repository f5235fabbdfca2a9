"""The expert activations in torch: silu's SwiGLU, and gpt-oss's clamped SwiGLU as transformers writes
it. (The Triton helper runs inside the kernels: test_fused_experts.py, test_grouped_experts.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_serve.engine.experts.activation import ExpertActivation


def test_default_is_swiglu():
    gate, up = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(0))
    assert torch.equal(ExpertActivation()(gate, up), F.silu(gate) * up)


def test_clamped_swiglu_is_gpt_oss_experts():
    alpha, limit = 1.702, 7.0
    gate = torch.tensor([-30.0, -7.5, -1.0, 0.0, 0.5, 6.9, 7.0, 7.5, 30.0])
    up = torch.tensor([30.0, -30.0, -7.5, 7.5, 1.0, -2.0, 0.0, 7.0, -7.0])
    # transformers' GptOssExperts, with gate and up already split
    glu = gate.clamp(max=limit) * torch.sigmoid(gate.clamp(max=limit) * alpha)
    expected = (up.clamp(min=-limit, max=limit) + 1) * glu
    got = ExpertActivation("clamped_swiglu", alpha=alpha, limit=limit)(gate, up)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    # gate 7.5 counts as the limit, up -7.5 as -limit; gate is not bounded below (-7.5, -30 pass as they are)
    torch.testing.assert_close(got[[7, 2]], torch.stack([8 * 7 * torch.sigmoid(torch.tensor(7 * alpha)),
                                                         -6 * -1 * torch.sigmoid(torch.tensor(-alpha))]))


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown expert activation 'gelu'"):
        ExpertActivation("gelu")
