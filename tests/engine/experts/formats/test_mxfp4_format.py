"""The mxfp4 format against OCP MX's definition: every E2M1 code and E8M0 scale decodes to its value,
codes pack low nibble first, encoding picks the least power-of-two scale that fits a block into
±6 and rounds to the nearest code (ties to the even one), so a weight moves by at most half a step.
"""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.experts.formats.mxfp4 import Mxfp4
from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.store import ExpertStore

BLOCK = 32


def _e2m1(code: int) -> float:
    """The value of an E2M1 code from its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    magnitude = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -magnitude if sign else magnitude


def _pack(codes: list[int]) -> torch.Tensor:
    return torch.tensor([codes[j] | codes[j + 1] << 4 for j in range(0, len(codes), 2)], dtype=torch.uint8)


@pytest.mark.parametrize("scale_byte,scale", [(127, 1.0), (130, 8.0), (120, 2.0**-7)])
def test_every_e2m1_code_decodes_to_its_value(scale_byte, scale):
    codes = list(range(16)) + list(range(15, -1, -1))  # one block
    got = Mxfp4().decode(_pack(codes)[None], torch.tensor([[scale_byte]], dtype=torch.uint8), BLOCK, torch.float32)
    assert got[0].tolist() == [_e2m1(c) * scale for c in codes]
    assert [_e2m1(c) for c in range(8)] == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_every_e8m0_scale_a_checkpoint_holds_is_its_power_of_two():
    scales = torch.arange(1, 255, dtype=torch.uint8)[:, None]  # [254, 1]; 0 and 255 are never written
    data = _pack([2] * BLOCK).expand(len(scales), -1)  # every weight 1.0
    got = Mxfp4().decode(data, scales, BLOCK, torch.float32)
    assert got[:, 0].tolist() == [2.0 ** (e - 127) for e in range(1, 255)]
    assert torch.equal(got, got[:, :1].expand_as(got))


def test_the_low_nibble_holds_the_even_weight():
    w = torch.zeros(1, BLOCK)
    w[0, :4] = torch.tensor([0.5, 6.0, -1.0, 3.0])  # scale 1: codes 1, 7, 10, 5
    data, scales = Mxfp4().encode(w)
    assert scales.tolist() == [[127]] and data[0, :2].tolist() == [1 | 7 << 4, 10 | 5 << 4]


def test_ties_round_to_the_even_code():
    w = torch.zeros(1, BLOCK)
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25]
    w[0, : len(ties) + 1] = torch.tensor([6.0, *ties])  # 6 sets the scale to 1
    got = Mxfp4().decode(*Mxfp4().encode(w), BLOCK, torch.float32)
    assert got[0, : len(ties) + 1].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, -0.0]


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(8, 32), (37, 96)])
def test_error_is_at_most_half_a_step_with_the_least_scale_that_fits(n, k, source):
    gen = torch.Generator().manual_seed(n)
    w = (torch.randn(n, k, generator=gen) * torch.logspace(-3, 2, k)).to(source).float()  # blocks of all ranges
    w[0] = 0.0  # an all-zero block decodes to zeros
    w[1, 5] = 1e4  # an outlier sets its block's scale
    data, scales = Mxfp4().encode(w)
    assert data.shape == (n, k // 2) and scales.shape == (n, k // BLOCK) and scales.dtype == torch.uint8
    got = Mxfp4().decode(data, scales, k, torch.float32)
    scale = torch.exp2(scales.float() - 127).repeat_interleave(BLOCK, dim=1)  # [N, K]
    scaled = w / scale
    absmax = scaled.abs().unflatten(1, (-1, BLOCK)).amax(-1)[1:]  # [N - 1, K / 32]
    assert ((absmax > 3) & (absmax <= 6)).all()  # fits ±6, and half the scale would not
    step = torch.where(scaled.abs() < 2, 0.5, torch.where(scaled.abs() < 4, 1.0, 2.0))  # E2M1's spacing
    assert ((got - w).abs() <= step / 2 * scale).all()
    assert torch.equal(got[0], torch.zeros(k))


def test_an_expert_takes_17_32_of_a_byte_per_weight():
    h, i = 4096, 14336  # Mixtral
    assert ExpertLayout(h, i, torch.bfloat16, Mxfp4()).nbytes == 3 * h * i * 17 // 32


def test_k_must_be_whole_blocks():
    with pytest.raises(ValueError, match="mxfp4 experts need matrices of whole 1 x 32 blocks; one is 64 x 48"):
        ExpertStore(1, 1, ExpertLayout(64, 48, torch.float32, Mxfp4()))
