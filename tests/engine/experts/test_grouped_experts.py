"""The grouped Triton expert kernel equals the torch gathered path it replaces at large batches.

The block layout (torch only) is checked on CPU for its invariants. The kernels run in Triton's
interpreter on CPU (TRITON_INTERPRET=1 must be set before the kernel module is imported, so
those cases run in a subprocess); on a GPU they are compiled, compared in bf16, and captured in
a CUDA graph. Quantized slots decoded in the kernel equal the torch path's reference
dequantization: on a GPU for every format, in the interpreter for the formats of small blocks
(slot_rows.interpreted_formats; the others' loads tile by tile in formats/test_triton_loads.py).
Skipped where triton is not installed.
"""
from __future__ import annotations

import importlib.util
import itertools
import json

import pytest
import torch

from moe_serve.engine.experts.compute import (
    GROUPED_MIN_PAIRS,
    gathered_experts,
    gathered_experts_torch,
)
from moe_serve.engine.experts.formats import FORMAT_NAMES
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

NUM_SLOTS = 9  # more slots than the routings below use
USED_SLOTS = 5
SHARED_SLOT = 3  # routed by every token
# (H, I, T, k): odd sizes, T in {1, 5, 17}, k in {1, 2, 4}, and k = 0 (every expert on the CPU)
CASES = [(h, i, t, k) for (h, i), t, k in itertools.product([(37, 19), (16, 24), (40, 33)], [1, 5, 17], [1, 2, 4])]
CASES += [(21, 13, 5, 0)]
# quantized formats, fewer cases (the interpreter is slow): odd K for int4's half-filled last byte
# and per-weight scales; K = 256 and 64 for tiles inside one int4 group and tiles of whole groups;
# 17 tokens of k = 4 (several blocks of a slot) under the default tiles only
QUANT_CASES = [(37, 19, 5, 2), (256, 64, 9, 2)]
QUANT_DEFAULT_TILE_CASES = [(40, 33, 17, 4)]
# int4-zp's tile codes (formats/base.py triton_codes_for) meet 16-bit activations only: fp16 here, the
# interpreter's bf16 dot not being numpy's; K = 256 and 64, tiles inside one group
CODE_CASES = [(256, 64, 9, 2), (64, 128, 5, 2)]
# (T, k, S, block_m) for the block layout alone
LAYOUT_CASES = [(1, 1, 1, 16), (17, 4, 9, 16), (64, 2, 8, 16), (32, 8, 64, 16), (9, 3, 40, 4), (50, 1, 3, 7),
                (64, 8, 2, 16)]
# (256, 4096, 13, 2): H's 4 tiles leave I in chunks (fused_experts.down_splits), as a verify pass of the bench model
CUDA_CASES = [(256, 128, 32, 2), (200, 72, 17, 4), (2048, 1024, 32, 2), (2048, 1024, 8, 8), (256, 4096, 13, 2)]
# gpt-oss's experts (biases, the clamped SwiGLU): the tiny tiles cut I = 19 (mxfp4's 32) into 2 chunks,
# of which one adds the down bias
GPT_OSS_CASES = [(37, 19, 5, 2)]
# on a GPU, in bf16: the second with I in chunks
GPT_OSS_CUDA_CASES = [(200, 72, 17, 4), (256, 4096, 13, 2)]


def grouped_problem(h: int, i: int, t: int, k: int, dtype: torch.dtype, device: str, seed: int = 0,
                    quant: str = "none", gpt_oss: bool = False):
    """`quant` experts in NUM_SLOTS slots; T tokens' k slots among the first USED_SLOTS (SHARED_SLOT routed
    by every token, one slot twice in the first token); x followed by NaNs."""
    gen = torch.Generator().manual_seed(seed)
    layout = quant_layout(h, i, dtype, quant, **(GPT_OSS_EXPERTS if gpt_oss else {}))
    slots = random_slots(layout, NUM_SLOTS, gen)  # [S, numel]
    x = torch.randn(t, h, generator=gen)  # [T, H]
    if gpt_oss:
        x *= GPT_OSS_INPUT_SCALE  # the clamps bind
    ids = torch.randint(0, USED_SLOTS, (t, k), generator=gen)  # [T, k]: slots repeat across tokens
    if k:
        ids[:, 0] = SHARED_SLOT
    if k > 1 and t:
        ids[0, -1] = ids[0, 0]  # the same slot twice in one token
    weights = torch.rand(t, k, generator=gen)  # [T, k]
    slots, x, ids, weights = (v.to(device) for v in (slots, x.to(dtype), ids, weights))
    return layout, slots, followed_by_nans(x), ids, weights


def tiny_config():
    """Tiles far smaller than the shapes (tl.dot's minimum): every kernel loops, every edge is masked."""
    from moe_serve.engine.experts.grouped_experts import GroupedConfig

    return GroupedConfig(block_m=16, gate_up_block_i=16, gate_up_block_h=16, gate_up_warps=1, gate_up_stages=1,
                         down_block_h=16, down_block_i=16, down_warps=1, down_stages=1)


def check_interpreted(cases: list[tuple[int, int, int, int]], quant: str = "none",
                      default_tile_cases: list[tuple[int, int, int, int]] = (), dtype: str = "float32",
                      gpt_oss: bool = False) -> None:
    """Run in the subprocess, with TRITON_INTERPRET=1: fp32 kernels (or fp16's) on CPU tensors vs
    torch, under small tiles and the default ones (`default_tile_cases`: the default ones only);
    gpt_oss: its experts' biases and clamped SwiGLU."""
    from moe_serve.engine.experts.grouped_experts import grouped_experts

    for (h, i, t, k), configs in tile_plan(cases, default_tile_cases, lambda h, i: tiny_config()):
        layout, slots, x, ids, weights = grouped_problem(h, i, t, k, getattr(torch, dtype), "cpu", quant=quant,
                                                         gpt_oss=gpt_oss)
        assert not gpt_oss or clamp_binds(layout, slots, x, ids)
        expected = gathered_experts_torch(x, weights, slots, ids, layout).float()  # [T, H]
        # fp16: both paths round act and the output to fp16, in different places
        tol = 1e-5 if dtype == "float32" else 3e-3 * expected.abs().max().item()
        for config in configs:
            got = grouped_experts(x, weights, slots, ids, layout, config=config)
            assert got.shape == (t, h) and got.dtype == x.dtype
            torch.testing.assert_close(got.float(), expected, rtol=tol, atol=tol,
                                       msg=lambda m: f"{quant} {(h, i, t, k)} {config}: {m}")


def _blocks_in_python(slot_ids: torch.Tensor, num_slots: int, block_m: int, kernel: bool,
                      routed_experts: int | None = None) -> tuple[list[tuple[int, list[int]]], int]:
    """Each real block's (slot, pairs), read off the layout the way the kernels read it; and the grid size."""
    from moe_serve.engine.experts.grouped_experts import block_layout

    layout = block_layout(slot_ids, num_slots, block_m, kernel=kernel, routed_experts=routed_experts)
    order = layout.order.tolist()
    blocks = []
    for block in range(layout.num_blocks.item()):
        first, rows = layout.block_first[block].item(), layout.block_rows[block].item()
        blocks.append((layout.block_slot[block].item(), order[first : first + rows]))
    return blocks, layout.block_slot.shape[0]


def check_block_layouts(cases: list[tuple[int, int, int, int]], kernel: bool) -> None:
    """Every pair lands in exactly one block of <= block_m pairs of one slot (the kernel's layout runs
    in the interpreter's subprocess)."""
    from moe_serve.engine.experts.grouped_experts import max_blocks

    for t, k, num_slots, block_m in cases:
        gen = torch.Generator().manual_seed(t * k)
        slot_ids = torch.randint(0, num_slots, (t, k), generator=gen)  # [T, k]
        blocks, grid = _blocks_in_python(slot_ids, num_slots, block_m, kernel)
        flat = slot_ids.reshape(-1).tolist()
        assert sorted(p for _, pairs in blocks for p in pairs) == list(range(t * k)), (t, k, blocks)
        for slot, pairs in blocks:
            assert 0 < len(pairs) <= block_m and all(flat[p] == slot for p in pairs), (t, k, blocks)
            assert pairs == sorted(pairs)  # a stable sort: each slot's pairs in routing order
        assert len(blocks) == sum(-(-flat.count(s) // block_m) for s in set(flat))  # only a slot's last block is short
        assert len(blocks) <= grid <= -(-t * k // block_m) + min(t * k, num_slots)
    # the bound is reached when every slot leaves one pair over
    blocks, grid = _blocks_in_python(torch.tensor([0] * 17 + [1] * 17 + [2]).view(-1, 1), 3, 16, kernel)
    assert len(blocks) == grid == max_blocks(35, 3, 16) == 5
    # a layer's 8 experts in slots 40-47 of a 48-slot cache: the grid is sized for 8 slots, not 48
    slot_ids = 40 + torch.stack([torch.randperm(8, generator=torch.Generator().manual_seed(t))[:2] for t in range(32)])
    blocks, grid = _blocks_in_python(slot_ids, 48, 16, kernel, routed_experts=8)
    assert sorted(p for _, pairs in blocks for p in pairs) == list(range(64))
    assert len(blocks) <= grid == max_blocks(64, 8, 16) == 11 < max_blocks(64, 48, 16)


@needs_triton
def test_interpreter_matches_torch_path():
    run_interpreted(__file__, f"check_interpreted({json.dumps(CASES)})")


@needs_triton
@pytest.mark.parametrize("quant", interpreted_formats() + MIXED_FORMATS)
def test_interpreter_decodes_quantized_slots_as_torch_does(quant):
    run_interpreted(__file__, f"check_interpreted({json.dumps(fitted_cases(QUANT_CASES, quant))}, {quant!r}, "
                              f"{json.dumps(fitted_cases(QUANT_DEFAULT_TILE_CASES, quant))})")


@needs_triton
@pytest.mark.parametrize("quant", ["none", "int4", "mxfp4"])
def test_interpreter_gpt_oss_experts_match_torch_path(quant):
    run_interpreted(__file__, f"check_interpreted({json.dumps(fitted_cases(GPT_OSS_CASES, quant))}, {quant!r}, "
                              "gpt_oss=True)")


@needs_triton
def test_block_layout_covers_every_pair_once_in_blocks_of_one_slot():
    run_interpreted(__file__, f"check_block_layouts({json.dumps(LAYOUT_CASES)}, kernel=True)")


@needs_triton
def test_eager_block_layout_covers_every_pair_once_in_blocks_of_one_slot():
    check_block_layouts(LAYOUT_CASES, kernel=False)



@needs_triton
@pytest.mark.parametrize("quant", ["int4-zp-g32", "int4-zp-g64"])
def test_interpreter_multiplies_tile_codes_as_the_torch_path(quant):
    run_interpreted(__file__, f"check_interpreted({json.dumps(fitted_cases(CODE_CASES, quant))}, {quant!r}, "
                              "dtype='float16')")


@needs_triton
def test_tile_codes_only_for_tiles_inside_one_group():
    from moe_serve.engine.experts.formats import expert_format

    zp_g32, zp_g128 = (expert_format(name, torch.float16) for name in ("int4-zp-g32", "int4-zp-g128"))
    assert zp_g32.triton_codes_for(4096, 32) and zp_g32.triton_codes_for(4096, 16)
    assert zp_g128.triton_codes_for(4096, 128) and not zp_g32.triton_codes_for(4096, 64)
    for name in ("int4", "q4_k"):  # decoded tiles
        assert expert_format(name, torch.float16).triton_codes_for(4096, 128) is None


@needs_triton
def test_down_chunks_fill_the_gpu_for_the_fewest_blocks_a_routing_gives():
    from moe_serve.engine.experts.fused_experts import MIN_PROGRAMS
    from moe_serve.engine.experts.grouped_experts import default_config, down_chunks

    cfg = default_config(256, 229376)  # the bench model: H 256 is 4 tiles of the down kernel
    # 32 tokens x top-2: as few as 4 full blocks, whatever the cache's slot count
    assert 4 * 4 * down_chunks(64, 256, 229376, cfg) >= MIN_PROGRAMS
    assert down_chunks(4096, 256, 229376, cfg) == 1  # a long prefill's blocks are programs enough
    mixtral = default_config(4096, 14336)
    assert down_chunks(64, 4096, 14336, mixtral) * 4 * 64 >= MIN_PROGRAMS


def test_cpu_keeps_the_torch_path_at_any_batch():
    layout, slots, x, ids, weights = grouped_problem(16, 8, 17, 4, torch.float32, "cpu")
    assert ids.numel() >= GROUPED_MIN_PAIRS
    torch.testing.assert_close(gathered_experts(x, weights, slots, ids, layout),
                               gathered_experts_torch(x, weights, slots, ids, layout), rtol=0, atol=0)


def _cuda_ready() -> bool:
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return False
    from moe_serve.engine.experts.fused_experts import fused_experts_available

    return fused_experts_available("cuda")


needs_cuda = pytest.mark.skipif(not _cuda_ready(), reason="needs a CUDA device and triton")


@needs_cuda
@pytest.mark.parametrize("quant", [*FORMAT_NAMES, *MIXED_FORMATS, "q4_k+q6_k"])
@pytest.mark.parametrize("h,i,t,k", CUDA_CASES)
def test_cuda_bf16_matches_torch_path(h, i, t, k, quant):
    (h, i, t, k), = fitted_cases([(h, i, t, k)], quant)
    from moe_serve.engine.experts.grouped_experts import grouped_experts

    layout, slots, x, ids, weights = grouped_problem(h, i, t, k, torch.bfloat16, "cuda", quant=quant)
    exact_layout, exact_slots = decoded_reference(layout, slots, torch.bfloat16)  # tl.dot takes bf16 tiles
    exact = gathered_experts_torch(x.float(), weights, exact_slots, ids, exact_layout)
    grouped = grouped_experts(x, weights, slots, ids, layout)
    assert grouped.dtype == torch.bfloat16 and grouped.shape == (t, h)
    # the output rounds, and so does act: tl.dot takes it in bf16 (the fused GEMV keeps it fp32), an error
    # of 2^-9 of each act summed over I that reaches ~1e-2 at 8 experts a token
    torch.testing.assert_close(grouped.float(), exact, rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(grouped, gathered_experts_torch(x, weights, slots, ids, layout), rtol=5e-2, atol=5e-2)
    assert torch.equal(grouped_experts(x, weights, slots, ids, layout), grouped)  # deterministic
    if t * k >= GROUPED_MIN_PAIRS:
        assert torch.equal(gathered_experts(x, weights, slots, ids, layout), grouped)  # the dispatch takes it


@needs_cuda
@pytest.mark.parametrize("quant", ["none", "int4", "mxfp4"])
@pytest.mark.parametrize("h,i,t,k", GPT_OSS_CUDA_CASES)
def test_cuda_bf16_gpt_oss_experts_match_torch_path(h, i, t, k, quant):
    (h, i, t, k), = fitted_cases([(h, i, t, k)], quant)
    from moe_serve.engine.experts.grouped_experts import grouped_experts

    layout, slots, x, ids, weights = grouped_problem(h, i, t, k, torch.bfloat16, "cuda", quant=quant, gpt_oss=True)
    assert clamp_binds(layout, slots, x, ids)
    exact_layout, exact_slots = decoded_reference(layout, slots, torch.bfloat16)  # biases and activation kept
    exact = gathered_experts_torch(x.float(), weights, exact_slots, ids, exact_layout)
    grouped = grouped_experts(x, weights, slots, ids, layout)
    assert grouped.dtype == torch.bfloat16 and grouped.shape == (t, h)
    # act rounds to bf16 for tl.dot (2^-9 of values up to (limit + 1) * limit), and so do the torch path's
    # gate, up and act: errors grow with the outputs
    scale = exact.abs().max().item()
    torch.testing.assert_close(grouped.float(), exact, rtol=1.6e-2, atol=2e-3 * scale)
    torch.testing.assert_close(grouped, gathered_experts_torch(x, weights, slots, ids, layout), rtol=5e-2,
                               atol=1e-2 * scale)
    assert torch.equal(gathered_experts(x, weights, slots, ids, layout), grouped)  # the dispatch takes it


@needs_cuda
@pytest.mark.parametrize("h,i,t,k", [(200, 72, 17, 4), (2048, 1024, 8, 2)])
def test_cuda_fp32_matches_torch_path(h, i, t, k):
    from moe_serve.engine.experts.grouped_experts import grouped_experts

    layout, slots, x, ids, weights = grouped_problem(h, i, t, k, torch.float32, "cuda")
    torch.testing.assert_close(grouped_experts(x, weights, slots, ids, layout),
                               gathered_experts_torch(x, weights, slots, ids, layout), rtol=1e-4, atol=1e-4)


@needs_cuda
def test_cuda_small_batches_keep_the_fused_kernel():
    from moe_serve.engine.experts.fused_experts import fused_experts

    layout, slots, x, ids, weights = grouped_problem(256, 128, 1, 2, torch.bfloat16, "cuda")
    assert ids.numel() < GROUPED_MIN_PAIRS
    assert torch.equal(gathered_experts(x, weights, slots, ids, layout), fused_experts(x, weights, slots, ids, layout))


@needs_cuda
@pytest.mark.parametrize("quant", ["none", "int4"])  # int4: grouped_int4.py's kernels
def test_cuda_graph_replays_new_routing(quant):
    from moe_serve.engine.experts.grouped_experts import grouped_experts

    layout, slots, x, ids, weights = grouped_problem(256, 128, 32, 2, torch.bfloat16, "cuda", quant=quant)
    grouped_experts(x, weights, slots, ids, layout)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_experts(x, weights, slots, ids, layout)
    _, _, x2, ids2, weights2 = grouped_problem(256, 128, 32, 2, torch.bfloat16, "cuda", seed=1, quant=quant)
    for new_ids in (ids2, torch.full_like(ids2, NUM_SLOTS - 1), torch.arange(64, device="cuda").view(32, 2) % NUM_SLOTS):
        for static, new in ((x, x2), (ids, new_ids), (weights, weights2)):  # the block count changes too
            static.copy_(new)
        graph.replay()
        torch.testing.assert_close(captured, grouped_experts(x2, weights2, slots, new_ids, layout), rtol=0, atol=0)


@needs_cuda
def test_cuda_new_token_counts_compile_nothing_new():
    """Prefills come in every length: after one run per power of two of pairs, the expert kernels
    must not compile again (their block-layout buffers once started at alignments that varied with
    the pair count, and each new mix compiled all three kernels, ~1 s on a prefill's path)."""
    from moe_serve.engine.experts import grouped_experts as grouped

    def variants() -> int:
        kernels = (grouped._align_kernel, grouped._gate_up_kernel, grouped._down_kernel)
        caches = [getattr(kernel, "device_caches", None) for kernel in kernels]
        if any(cache is None for cache in caches):
            pytest.skip("this triton keeps its compiled kernels elsewhere")
        return sum(len(cache[torch.cuda.current_device()][0]) for cache in caches)

    for t in (16, 17, 32, 33):  # each P_PAD of the lengths below, with P both even and odd multiples of 16
        layout, slots, x, ids, weights = grouped_problem(256, 128, t, 2, torch.bfloat16, "cuda")
        grouped.grouped_experts(x, weights, slots, ids, layout)
    compiled = variants()
    for t in range(17, 60):
        layout, slots, x, ids, weights = grouped_problem(256, 128, t, 2, torch.bfloat16, "cuda", seed=t)
        grouped.grouped_experts(x, weights, slots, ids, layout)
    assert variants() <= compiled + 2  # at most P's own specialization (a multiple of 16 or not) at new sizes


@needs_cuda
def test_cuda_both_block_layouts_agree_and_the_eager_one_never_syncs():
    from moe_serve.engine.experts.grouped_experts import block_layout

    for t, k, num_slots, block_m in LAYOUT_CASES:
        slot_ids = torch.randint(0, num_slots, (t, k), generator=torch.Generator().manual_seed(t)).cuda()
        torch.cuda.set_sync_debug_mode("error")
        try:
            eager = block_layout(slot_ids, num_slots, block_m, kernel=False)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        kernel = block_layout(slot_ids, num_slots, block_m, kernel=True)
        real = int(kernel.num_blocks)
        assert int(eager.num_blocks) == real and torch.equal(eager.order, kernel.order)
        for name in ("block_slot", "block_first", "block_rows"):
            assert torch.equal(getattr(eager, name)[:real], getattr(kernel, name)[:real]), name
