"""The int4-zp formats (asymmetric int4 groups with zero points, GPTQ's and AWQ's weights): encoding
moves a weight by at most half a step of its group and keeps 0 exact; a row is its codes, low
nibble first, then its zeros packed alike and padded to 16 bytes; already quantized groups are
kept exactly; matrices of ragged groups are refused by name; the Triton load decodes any tile as
the reference does (the whole kernels are held to it in test_fused_experts / test_grouped_experts).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve.engine.experts.formats import expert_format
from moe_serve.engine.experts.formats.int4_zp import dequantize
from moe_serve.engine.experts.layout import ExpertLayout
from tests.triton_interpreter import needs_triton, run_interpreted

GROUP_SIZES = (32, 64, 128)


def _format(group_size: int):
    return expert_format(f"int4-zp-g{group_size}", torch.float32)


def _weights(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5 + 0.3 * torch.rand(n, 1, generator=gen) / k**0.5  # off-centre rows
    w[0] = 0.0  # an all-zero row must survive (no 0/0 scale)
    w[1, 0] = 40.0 / k**0.5  # an outlier: it sets its group's range
    w[2, 3:9] = 0.0  # zeros inside a group decode exactly
    w[3, : k // 2] = w[3, : k // 2].abs()  # groups all positive: the range widened to 0, zero point 0
    return w


@pytest.mark.parametrize("group_size", GROUP_SIZES)
@pytest.mark.parametrize("groups", [1, 3])
def test_error_is_at_most_half_a_step_of_its_group_and_zero_is_exact(group_size, groups):
    fmt, (n, k) = _format(group_size), (7, groups * group_size)
    w = _weights(n, k)
    data, scales = fmt.encode(w)
    assert data.dtype == torch.uint8 and data.shape == (n, fmt.data_cols(k))
    assert scales.dtype == torch.float16 and scales.shape == (n, groups)
    got = fmt.decode(data, scales, k, torch.float32)
    step = scales.float().repeat_interleave(group_size, dim=1)  # [N, K] each weight's group scale
    assert ((got - w).abs() <= step / 2 * (1 + 1e-3)).all()
    assert (got[w == 0] == 0).all()
    spans = w.unflatten(1, (groups, group_size))
    ranges = spans.amax(-1).clamp(min=0) - spans.amin(-1).clamp(max=0)  # [N, G], 0 included
    nonzero = ranges > 0
    # scale = range / 15 rounded up to fp16: 16 levels span the group's range
    assert (scales.float()[nonzero] * 15 >= ranges[nonzero]).all()
    torch.testing.assert_close(scales.float()[nonzero], (ranges / 15)[nonzero], rtol=2**-10, atol=0)


def test_smaller_groups_follow_the_weights_closer():
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) / 512**0.5
    errors = [(_format(g).decode(*_format(g).encode(w), 512, torch.float32) - w).norm() / w.norm() for g in GROUP_SIZES]
    assert errors[0] < errors[1] < errors[2] < 0.11


def test_a_row_is_codes_low_nibble_first_then_zeros_padded_to_16_bytes():
    fmt = _format(32)
    codes = torch.arange(64, dtype=torch.uint8)[None] % 16  # one row of two groups
    zeros = torch.tensor([[3, 12]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 2.0]], dtype=torch.float16)
    data, kept = fmt.pack(codes, zeros, scales)
    assert fmt.data_cols(64) == 48 and data.shape == (1, 48)
    assert data[0, :32].tolist() == [(2 * j % 16) | (2 * j + 1) % 16 << 4 for j in range(32)]
    assert data[0, 32].item() == 3 | 12 << 4 and data[0, 33:].eq(0).all()
    assert kept is scales
    expected = (codes.float() - zeros.float().repeat_interleave(32, 1)) * scales.float().repeat_interleave(32, 1)
    assert torch.equal(fmt.decode(data, kept, 64, torch.float32), expected)
    assert torch.equal(dequantize(codes, zeros, scales, torch.float32), expected)


@pytest.mark.parametrize("groups,padded", [(1, 16), (2, 16), (31, 16), (32, 16), (33, 32), (64, 32), (65, 48)])
def test_zero_points_take_half_a_byte_each_padded_to_16(groups, padded):
    assert _format(32).data_cols(32 * groups) == 16 * groups + padded


def test_an_odd_number_of_groups_ends_in_a_half_byte_of_zero():
    fmt = _format(32)
    codes, zeros = torch.zeros(2, 96, dtype=torch.uint8), torch.tensor([[1, 2, 15], [4, 5, 6]], dtype=torch.uint8)
    data, _ = fmt.pack(codes, zeros, torch.ones(2, 3, dtype=torch.float16))
    assert data[:, 48:50].tolist() == [[1 | 2 << 4, 15], [4 | 5 << 4, 6]] and data[:, 50:].eq(0).all()


@pytest.mark.parametrize("group_size", GROUP_SIZES)
def test_bytes_per_expert_are_the_published_ones(group_size):
    h, i = 4096, 14336  # Mixtral: half a byte a weight, 2.5 bytes a group, zeros' rows padded to 16 bytes
    layout = ExpertLayout(h, i, torch.bfloat16, expert_format(f"int4-zp-g{group_size}", torch.bfloat16))
    weights = 3 * h * i
    assert weights * (0.5 + 2.5 / group_size) <= layout.nbytes <= weights * (0.5 + 2.5 / group_size) + 16 * 3 * i
    assert layout.nbytes / ExpertLayout(h, i, torch.bfloat16).nbytes < 0.26 + 1.25 / group_size


def test_ragged_groups_are_refused_by_name():
    with pytest.raises(ValueError, match="int4-zp-g64 experts need matrices of whole 1 x 64 blocks; one is 32 x 96"):
        ExpertLayout(96, 32, torch.float32, _format(64)).sections
    with pytest.raises(ValueError, match="int4-zp-g32 experts need matrices of whole 1 x 32 blocks"):
        _format(32).encode(torch.randn(4, 48))


# (format, K, BLOCK_K) beyond test_triton_loads.py's cases: 32 and 34 groups a row, whose zero points
# pad to 16 and 32 bytes; a tile of whole groups past K; a narrow tile inside a group of 128
LOAD_CASES = [("int4-zp-g32", 1024, 256), ("int4-zp-g32", 1088, 256), ("int4-zp-g128", 384, 512),
              ("int4-zp-g128", 256, 8), ("int4-zp-g64", 256, 128)]


@needs_triton
def test_the_triton_load_decodes_every_tile_as_decode_does():
    run_interpreted(str(Path(__file__).with_name("test_triton_loads.py")), f"check_loads_interpreted({LOAD_CASES!r})")
