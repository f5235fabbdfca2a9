"""Every format's Triton load decodes every tile as the format's reference decode does: plain and
transposed, tiles narrower than a block, of one block and of several, a last tile past K, and
masked rows. Run in Triton's interpreter on CPU.

This is where formats of large blocks (fp8-block's 128 rows, int4-zp's 64 and 128, the k-quants'
256) meet the interpreter: their whole-kernel cases grow to 256 x 256 and take minutes each
there, so test_fused_experts / test_grouped_experts interpret the whole kernels for the formats
of blocks of at most 32, and hold every format to the torch path on the GPU.
"""
from __future__ import annotations

import math

import pytest
import torch

from moe_serve.engine.experts.formats import FORMAT_NAMES, expert_format
from tests.triton_interpreter import needs_triton, run_interpreted

QUANTIZED = [name for name in FORMAT_NAMES if name != "none"]
ROWS = 6  # not a multiple of the 4 rows a program loads: the last program's rows are masked


def load_cases(name: str) -> list[tuple[str, int, int]]:
    """(format, K, BLOCK_K) for K of three blocks (96 where K is free) and one block more, under
    tiles from the kernels' narrowest (8, the tests' tiny configs) to wider than K."""
    unit = max(expert_format(name, torch.float32).col_multiple, 8)  # no kernel tile is narrower than 8
    k = 3 * max(unit, 32)
    return [(name, kk, block_k) for kk in (k, k + max(unit, 32))
            for block_k in sorted({8, 16, unit, 2 * unit, triton_tile_past(kk)})]


def triton_tile_past(k: int) -> int:
    """The power-of-two tile the kernels take for a dim of k: past k unless k is one."""
    return 1 << math.ceil(math.log2(k))


def weights(n: int, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen) / k**0.5 + 0.3 * torch.rand(n, 1, generator=gen) / k**0.5  # off-centre rows
    w[0] = 0.0  # an all-zero row
    w[1, 0] = 40.0 / k**0.5  # an outlier sets its row's, group's or block's scale
    return w


def check_loads_interpreted(cases: list[tuple[str, int, int]]) -> None:
    """Run with TRITON_INTERPRET=1: every tile triton_load gives, plain and transposed, equals decode's."""
    import triton
    import triton.language as tl

    @triton.jit
    def tiles(w_ptr, s_ptr, out_ptr, out_t_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
              LOAD: tl.constexpr):
        rows = tl.program_id(0) * 4 + tl.arange(0, 4)
        row_ok = rows < N
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            at = rows[:, None] * K + cols[None, :]
            mask = row_ok[:, None] & (cols < K)[None, :]
            tl.store(out_ptr + at, LOAD(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, False, ""), mask=mask)
            tl.store(out_t_ptr + at, tl.trans(LOAD(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, True, "")), mask=mask)

    for name, k, block_k in cases:
        fmt = expert_format(name, torch.float32)
        data, scales = fmt.encode(weights(ROWS, k))
        expected = fmt.decode(data, scales, k, torch.float32)
        out, out_t = torch.full((ROWS, k), torch.nan), torch.full((ROWS, k), torch.nan)
        # a format without scales gets its data again: the kernels pass the row's one view twice
        tiles[(triton.cdiv(ROWS, 4),)](data, data if scales is None else scales, out, out_t, N=ROWS, K=k,
                                      BLOCK_K=block_k, LOAD=fmt.triton_load)
        for got in (out, out_t):
            assert torch.equal(got, expected), (name, k, block_k)


@needs_triton
@pytest.mark.parametrize("name", QUANTIZED)
def test_the_triton_load_decodes_every_tile_as_decode_does(name):
    run_interpreted(__file__, f"check_loads_interpreted({load_cases(name)!r})")
