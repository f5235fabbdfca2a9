"""The fused Triton expert kernel equals the torch gathered path it replaces.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 must be set before the kernel
module is imported, so those cases run in a subprocess); on a GPU they are compiled, compared in
bf16, and captured in a CUDA graph. Quantized slots decoded in the kernel equal the torch path's
reference dequantization: on a GPU for every format, in the interpreter for the formats of small
blocks (slot_rows.interpreted_formats; the others' loads tile by tile in
formats/test_triton_loads.py). Skipped where triton is not installed.
"""
from __future__ import annotations

import json

import pytest
import torch

from moe_serve.engine.experts.compute import (
    GROUPED_MIN_PAIRS,
    gathered_experts,
    gathered_experts_torch,
)
from moe_serve.engine.experts.formats import FORMAT_NAMES
from moe_serve.engine.experts.fused_experts import (
    MIN_PROGRAMS,
    FusedConfig,
    chunk_length,
    down_splits,
    fused_experts,
    fused_experts_available,
)
from tests.engine.experts.slot_rows import (
    GPT_OSS_EXPERTS,
    GPT_OSS_INPUT_SCALE,
    MIXED_FORMATS,
    clamp_binds,
    decoded_reference,
    fitted_cases,
    followed_by_nans,
    interpreted_formats,
    quant_layout,
    random_slots,
    tile_plan,
)
from tests.triton_interpreter import needs_triton, run_interpreted

# Blocks far smaller than the shapes: every kernel loops, and every edge is masked.
TINY = FusedConfig(gate_up_rows=4, gate_up_cols=8, gate_up_warps=1, down_rows=4, down_cols=8, down_warps=1)
# for dims past 64, still tiles far narrower than an int4 group and many loop steps, a quarter of
# TINY's steps (in the interpreter the 256 x 64 case took 42 s under TINY)
NARROW = FusedConfig(gate_up_rows=8, gate_up_cols=32, gate_up_warps=1, down_rows=8, down_cols=32, down_warps=1)
# (H, I, T, k): odd sizes, T in {1, 3}, k in {0, 1, 2, 4}
CASES = [(37, 19, 1, 1), (37, 19, 3, 2), (16, 24, 3, 4), (40, 33, 1, 4), (24, 8, 3, 1), (21, 13, 1, 0)]
# quantized formats, fewer cases (the interpreter is slow): odd K for int4's half-filled last byte
# and per-weight scales; K = 256 and 64 for tiles inside one int4 group and tiles of whole groups;
# k = 4 under the default tiles only (the small tiles take ~10x as long there, and add no edge)
QUANT_CASES = [(37, 19, 3, 2), (256, 64, 2, 2)]
QUANT_DEFAULT_TILE_CASES = [(40, 33, 1, 4)]
# (256, 4096, 1, 2): H's 32 row blocks of 8 leave I in chunks (down_splits), as on the bench model
CUDA_CASES = [(256, 128, 1, 8), (256, 128, 3, 8), (200, 72, 4, 2), (2048, 1024, 1, 8), (256, 4096, 1, 2)]
# gpt-oss's experts (biases, the clamped SwiGLU): TINY cuts I = 19 into 3 chunks, of which one adds
# the down bias
GPT_OSS_CASES = [(37, 19, 3, 2)]
# on a GPU, in bf16: the second with I in chunks
GPT_OSS_CUDA_CASES = [(200, 72, 4, 2), (256, 4096, 1, 2)]


def _problem(h: int, i: int, t: int, k: int, dtype: torch.dtype, device: str, seed: int = 0, quant: str = "none",
             gpt_oss: bool = False):
    gen = torch.Generator().manual_seed(seed)
    layout = quant_layout(h, i, dtype, quant, **(GPT_OSS_EXPERTS if gpt_oss else {}))
    slots = random_slots(layout, 5, gen)  # [S, numel]
    x = torch.randn(t, h, generator=gen)  # [T, H]
    if gpt_oss:
        x *= GPT_OSS_INPUT_SCALE  # the clamps bind
    ids = torch.randint(0, 5, (t, k), generator=gen)  # [T, k]
    if k > 1:
        ids[0, -1] = ids[0, 0]  # the same slot twice in one token
    if t > 1 and k:
        ids[-1, 0] = ids[0, 0]  # and across tokens
    weights = torch.rand(t, k, generator=gen)  # [T, k]
    slots, x, ids, weights = (v.to(device) for v in (slots, x.to(dtype), ids, weights))
    return layout, slots, followed_by_nans(x), ids, weights


def check_interpreted(cases: list[tuple[int, int, int, int]], quant: str = "none",
                      default_tile_cases: list[tuple[int, int, int, int]] = (), gpt_oss: bool = False) -> None:
    """Run in the subprocess, with TRITON_INTERPRET=1: fp32 kernels on CPU tensors vs torch, under
    small tiles and the default ones (`default_tile_cases`: the default ones only); gpt_oss: its
    experts' biases and clamped SwiGLU."""
    for (h, i, t, k), configs in tile_plan(cases, default_tile_cases, lambda h, i: TINY if max(h, i) <= 64 else NARROW):
        layout, slots, x, ids, weights = _problem(h, i, t, k, torch.float32, "cpu", quant=quant, gpt_oss=gpt_oss)
        assert not gpt_oss or clamp_binds(layout, slots, x, ids)
        expected = gathered_experts_torch(x, weights, slots, ids, layout)  # [T, H]
        for config in configs:
            got = fused_experts(x, weights, slots, ids, layout, config=config)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5,
                                       msg=lambda m: f"{quant} {(h, i, t, k)} {config}: {m}")


needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and fused_experts_available("cuda")),
                                reason="needs a CUDA device and triton")


@needs_triton
def test_interpreter_matches_torch_path():
    run_interpreted(__file__, f"check_interpreted({json.dumps(CASES)})")


@needs_triton
@pytest.mark.parametrize("quant", interpreted_formats() + MIXED_FORMATS)
def test_interpreter_decodes_quantized_slots_as_torch_does(quant):
    cases = fitted_cases(QUANT_CASES, quant)
    if cases[0] != QUANT_CASES[0]:
        # a block format: fitted to whole blocks, the odd case is gone and TINY's tiles would only cut its
        # blocks, which formats/test_triton_loads.py checks at every tile width (8-11 s here a format)
        cases = cases[1:]
    run_interpreted(__file__, f"check_interpreted({json.dumps(cases)}, {quant!r}, "
                              f"{json.dumps(fitted_cases(QUANT_DEFAULT_TILE_CASES, quant))})")


@needs_triton
@pytest.mark.parametrize("quant,small_tiles", [("none", True), ("int4", True), ("mxfp4", False)])
def test_interpreter_gpt_oss_experts_match_torch_path(quant, small_tiles):
    """Biases and the clamped SwiGLU through the tile loads (none, mxfp4, gpt-oss's published format:
    under the default tiles only, TINY's take 4 s there) and int4's tile dot."""
    cases = fitted_cases(GPT_OSS_CASES, quant)
    run_interpreted(__file__, f"check_interpreted({json.dumps(cases if small_tiles else [])}, {quant!r}, "
                              f"{json.dumps([] if small_tiles else cases)}, gpt_oss=True)")


def test_down_splits_cut_a_wide_I_into_whole_tiles_until_the_programs_fill_the_gpu():
    # the bench model's down matrix at one token: H 256 in 32 blocks of 8 rows, I 229,120 in 224 tiles
    assert down_splits(32, 229120, 1024) == 16 and 32 * 16 >= MIN_PROGRAMS
    assert down_splits(512, 14336, 1024) == 1  # Mixtral's H 4096: whole rows are programs enough
    assert down_splits(1, 19, 8) == 3  # never more chunks than tiles
    for blocks, i, block_i in [(7, 5000, 128), (3, 1790 * 128, 128), (100, 99, 16), (64, 229120, 1024)]:
        tiles, n = -(-i // block_i), down_splits(blocks, i, block_i)
        assert tiles % n == 0 and (blocks * n >= MIN_PROGRAMS or n == tiles)
        assert all(tiles % m or blocks * m < MIN_PROGRAMS for m in range(1, n))  # the fewest that do
    assert chunk_length(229120, 1024, 16) == 14 * 1024  # whole tiles, the last one past I
    with pytest.raises(AssertionError, match="do not divide"):
        chunk_length(229120, 1024, 3)


def test_not_available_on_cpu():
    assert not fused_experts_available("cpu")
    layout, slots, x, ids, weights = _problem(16, 8, 1, 2, torch.float32, "cpu")
    torch.testing.assert_close(gathered_experts(x, weights, slots, ids, layout),
                               gathered_experts_torch(x, weights, slots, ids, layout), rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("quant", [*FORMAT_NAMES, *MIXED_FORMATS, "q4_k+q6_k"])
@pytest.mark.parametrize("h,i,t,k", CUDA_CASES)
def test_cuda_bf16_matches_torch_path(h, i, t, k, quant):
    (h, i, t, k), = fitted_cases([(h, i, t, k)], quant)
    layout, slots, x, ids, weights = _problem(h, i, t, k, torch.bfloat16, "cuda", quant=quant)
    exact_layout, exact_slots = decoded_reference(layout, slots, torch.float32)  # the GEMV multiplies in fp32
    exact = gathered_experts_torch(x.float(), weights, exact_slots, ids, exact_layout)
    fused = fused_experts(x, weights, slots, ids, layout)
    assert fused.dtype == torch.bfloat16 and fused.shape == (t, h)
    torch.testing.assert_close(fused.float(), exact, rtol=1.6e-2, atol=1e-2)  # only the final cast rounds
    torch.testing.assert_close(fused, gathered_experts_torch(x, weights, slots, ids, layout), rtol=5e-2, atol=5e-2)
    if t * k < GROUPED_MIN_PAIRS:  # from there on the dispatch takes the grouped kernel (its own tests)
        assert torch.equal(gathered_experts(x, weights, slots, ids, layout), fused)


@needs_cuda
@pytest.mark.parametrize("quant", ["none", "int4", "mxfp4"])
@pytest.mark.parametrize("h,i,t,k", GPT_OSS_CUDA_CASES)
def test_cuda_bf16_gpt_oss_experts_match_torch_path(h, i, t, k, quant):
    (h, i, t, k), = fitted_cases([(h, i, t, k)], quant)
    layout, slots, x, ids, weights = _problem(h, i, t, k, torch.bfloat16, "cuda", quant=quant, gpt_oss=True)
    assert clamp_binds(layout, slots, x, ids)
    exact_layout, exact_slots = decoded_reference(layout, slots, torch.float32)  # biases and activation kept
    exact = gathered_experts_torch(x.float(), weights, exact_slots, ids, exact_layout)
    fused = fused_experts(x, weights, slots, ids, layout)
    assert fused.dtype == torch.bfloat16 and fused.shape == (t, h)
    torch.testing.assert_close(fused.float(), exact, rtol=1.6e-2, atol=1e-2)  # only the final cast rounds
    scale = exact.abs().max().item()  # bf16's torch path rounds gate, up and act: errors grow with them
    torch.testing.assert_close(fused, gathered_experts_torch(x, weights, slots, ids, layout), rtol=5e-2,
                               atol=1e-2 * scale)
    assert torch.equal(gathered_experts(x, weights, slots, ids, layout), fused)  # the dispatch takes it


@needs_cuda
def test_cuda_graph_replays_new_inputs():
    layout, slots, x, ids, weights = _problem(256, 2048, 2, 4, torch.bfloat16, "cuda")  # I in chunks, summed
    fused_experts(x, weights, slots, ids, layout)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_experts(x, weights, slots, ids, layout)
    _, _, x2, ids2, weights2 = _problem(256, 2048, 2, 4, torch.bfloat16, "cuda", seed=1)
    for static, new in ((x, x2), (ids, ids2), (weights, weights2)):
        static.copy_(new)
    graph.replay()
    torch.testing.assert_close(captured, fused_experts(x2, weights2, slots, ids2, layout), rtol=0, atol=0)
