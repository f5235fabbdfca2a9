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
from moe_serve.engine.experts.formats.base import ExpertFormat
from tests.triton_interpreter import needs_triton, run_interpreted

QUANTIZED = [name for name in FORMAT_NAMES if name != "none"]
ROWS = 6  # not a multiple of the 4 rows a program loads: the last program's rows are masked


def load_cases(name: str) -> list[tuple[str, int, int]]:
    """(format, K, BLOCK_K) for K of three blocks (96 where K is free) and one block more, under
    tiles from the kernels' narrowest (8, the tests' tiny configs; 16 for blocks past 32) to wider than K, a quarter and half
    a block among them (where a k-quant's tile order changes)."""
    unit = max(expert_format(name, torch.float32).col_multiple, 8)  # no kernel tile is narrower than 8
    # 8 only for blocks of at most 32: larger blocks' kernels run only on the GPU, under tiles no
    # narrower than tl.dot's 16 (8-wide tiles over a K of 256-weight blocks took seconds a case here)
    narrowest = 8 if unit <= 32 else 16
    k = 3 * max(unit, 32)
    return [(name, kk, block_k) for kk in (k, k + max(unit, 32))
            for block_k in sorted({narrowest, 16, max(unit // 4, 8), unit // 2, unit, 2 * unit, triton_tile_past(kk)})]


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
    """Run with TRITON_INTERPRET=1: every tile triton_load gives, plain and transposed, equals decode's
    at the columns triton_cols names."""
    import triton
    import triton.language as tl

    @triton.jit
    def tiles(w_ptr, s_ptr, out_ptr, out_t_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
              LOAD: tl.constexpr, COLS: tl.constexpr):
        rows = tl.program_id(0) * 4 + tl.arange(0, 4)
        row_ok = rows < N
        for k0 in range(0, K, BLOCK_K):
            cols = COLS(k0, BLOCK_K)
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
                                      BLOCK_K=block_k, LOAD=fmt.triton_load, COLS=fmt.triton_cols)
        for got in (out, out_t):
            assert torch.equal(got, expected), (name, k, block_k)


@needs_triton
@pytest.mark.parametrize("name", QUANTIZED)
def test_the_triton_load_decodes_every_tile_as_decode_does(name):
    run_interpreted(__file__, f"check_loads_interpreted({load_cases(name)!r})")


def check_dots_interpreted(cases: list[tuple[str, int, int]]) -> None:
    """Run with TRITON_INTERPRET=1: triton_dot over every tile of a row, summed as the fused kernels sum
    it, equals the decoded rows times the vector (up to fp32 rounding)."""
    import triton
    import triton.language as tl

    @triton.jit
    def dots(w_ptr, s_ptr, v_ptr, out_ptr, N: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
             DOT: tl.constexpr):
        rows = tl.program_id(0) * 4 + tl.arange(0, 4)
        row_ok = rows < N
        total = tl.zeros([4], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            total += DOT(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr)
        tl.store(out_ptr + rows, total, mask=row_ok)

    for name, k, block_k in cases:
        fmt = expert_format(name, torch.float32)
        data, scales = fmt.encode(weights(ROWS, k))
        v = torch.randn(k, generator=torch.Generator().manual_seed(block_k))
        out = torch.full((ROWS,), torch.nan)
        dots[(triton.cdiv(ROWS, 4),)](data, data if scales is None else scales, v, out, N=ROWS, K=k,
                                      BLOCK_K=block_k, DOT=fmt.triton_dot)
        torch.testing.assert_close(out, fmt.decode(data, scales, k, torch.float32) @ v, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{name} K={k} BLOCK_K={block_k}: {m}")


@needs_triton
@pytest.mark.parametrize("name", [name for name in QUANTIZED  # those with a dot (read without triton)
                                  if type(expert_format(name, torch.float32)).triton_dot is not ExpertFormat.triton_dot])
def test_the_triton_dot_multiplies_every_tile_as_the_decoded_rows_do(name):
    run_interpreted(__file__, f"check_dots_interpreted({load_cases(name)!r})")
