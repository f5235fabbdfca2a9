"""bench/quant_experts.py's pieces that need no GPU: every format encodes the same bf16 experts,
and the fp32 reference the kernels are scored against decodes what is stored."""
from __future__ import annotations

import pytest
import torch

from bench.fused_experts import Shape
from bench.quant_experts import Problem, encoded_slots, fp32_reference
from moe_serve.engine.experts.compute import gathered_experts_torch
from moe_serve.engine.experts.layout import ExpertLayout

SHAPE = Shape("tiny", hidden=32, intermediate=24, experts=4, top_k=2, layers=1)


# an expert's output error on Gaussian weights: SwiGLU multiplies two noisy projections, so int4's
# ~11% per weight (one group per row at these dims) gives ~23% here
@pytest.mark.parametrize("quant,rel", [("none", 1e-6), ("int8", 0.02), ("int4", 0.3), ("fp8", 0.08)])
def test_formats_encode_the_same_experts_and_the_reference_decodes_them(quant, rel):
    gen = torch.Generator().manual_seed(0)
    bf16 = ExpertLayout(SHAPE.hidden, SHAPE.intermediate, torch.bfloat16)
    plain = [(torch.randn(SHAPE.experts, bf16.numel, generator=gen) / SHAPE.hidden**0.5).to(torch.bfloat16)]
    layout, slots = encoded_slots(SHAPE, quant, plain)
    assert slots[0].dtype == layout.row_dtype and layout.nbytes <= bf16.nbytes
    ids = torch.tensor([[0, 2], [3, 0], [1, 2]])  # [T, k]
    x = torch.randn(3, SHAPE.hidden, generator=gen).to(torch.bfloat16)
    weights = torch.rand(3, 2, generator=gen)
    got = fp32_reference(Problem(layout, slots, [ids], x, weights), quant)  # [T, H]
    bf16_out = fp32_reference(Problem(bf16, plain, [ids], x, weights), "none")
    assert (got - bf16_out).norm() / bf16_out.norm() < rel
    torch.testing.assert_close(got, gathered_experts_torch(x, weights, slots[0], ids, layout).float(),
                               rtol=0.05, atol=0.05)  # the bf16 torch path, rounded
