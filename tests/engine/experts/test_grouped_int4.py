"""The grouped int4 kernels (grouped_int4.py) equal fp32 math on the same int4 weights, and the grouped
path takes them for int4 experts only.

The kernels run in Triton's interpreter on CPU (TRITON_INTERPRET=1, in tests/triton_interpreter.py's
worker process) in fp16: the interpreter's bf16 dot is not numpy's. On a GPU they are compiled and
compared in bf16 (test_grouped_experts.py's CUDA cases and graph capture take them too, for int4 at
dims of whole groups). Skipped where triton is not installed.
"""
from __future__ import annotations

import json

import pytest
import torch

from moe_serve.engine.experts.compute import GROUPED_MIN_PAIRS, gathered_experts, gathered_experts_torch
from tests.engine.experts.slot_rows import clamp_binds, decoded_reference, quant_layout
from tests.engine.experts.test_grouped_experts import grouped_problem, needs_cuda
from tests.triton_interpreter import needs_triton, run_interpreted

# (H, I, T, k); T = 0 and k = 0 launch nothing, 1 and 5 leave most of a block empty, 17 (the shared slot's
# 17 pairs) cross one
TOKEN_CASES = [(256, 128, t, 2) for t in (0, 1, 5, 17)] + [(256, 128, 3, 0)]
# a loop step of two groups over H = 384, its second half past H; down's I = 256 in two chunks of one step
MASKED_STEP_CASES = [(384, 256, 5, 2)]
# gpt-oss's biases and clamped SwiGLU; I = 384 in three chunks, of which one adds down's bias
GPT_OSS_CASES = [(128, 384, 5, 2)]


def small_config(down_splits: int | None = None):
    """Tiles narrower than the defaults: several programs of rows, K steps of two groups."""
    from moe_serve.engine.experts.grouped_experts import GroupedConfig

    return GroupedConfig(block_m=16, gate_up_block_i=32, gate_up_block_h=256, gate_up_warps=1, gate_up_stages=1,
                         down_block_h=32, down_block_i=128, down_warps=1, down_stages=1, down_splits=down_splits)


def wide_config(down_splits: int | None = None):
    """Tiles of 256 rows and outputs: past I = 384 and H = 128, so their loads are masked (the kernels
    drop those masks where a tile divides its dim, as the defaults' do)."""
    from moe_serve.engine.experts.grouped_experts import GroupedConfig

    return GroupedConfig(block_m=16, gate_up_block_i=256, gate_up_block_h=128, gate_up_warps=1, gate_up_stages=1,
                         down_block_h=256, down_block_i=128, down_warps=1, down_stages=1, down_splits=down_splits)


def _exact(layout, slots, x, ids, weights) -> torch.Tensor:
    """fp32 math on the int4 weights decoded in fp32: the kernels never round a weight to x's dtype."""
    exact_layout, exact_slots = decoded_reference(layout, slots, torch.float32)
    return gathered_experts_torch(x.float(), weights, exact_slots, ids, exact_layout)  # [T, H]


def check_interpreted(cases: list[tuple[int, int, int, int]], down_splits: int | None = None,
                      gpt_oss: bool = False, wide: bool = False) -> None:
    """Run in the interpreter's worker: fp16 kernels on CPU tensors, under the default tiles and small ones
    (and wide ones)."""
    from moe_serve.engine.experts import grouped_int4
    from moe_serve.engine.experts.grouped_experts import grouped_experts, kernels_for

    for h, i, t, k in cases:
        layout, slots, x, ids, weights = grouped_problem(h, i, t, k, torch.float16, "cpu", seed=t, quant="int4",
                                                         gpt_oss=gpt_oss)
        assert kernels_for(x, layout) is grouped_int4.KERNELS
        assert not gpt_oss or clamp_binds(layout, slots, x, ids)
        exact = _exact(layout, slots, x, ids, weights)
        # act and the output round to fp16 (2^-11), the weights not at all
        tol = 2e-3 * max(exact.abs().max().item() if exact.numel() else 0.0, 1.0)
        configs = (None, small_config(down_splits)) + ((wide_config(down_splits),) if wide else ())
        for config in configs:
            got = grouped_experts(x, weights, slots, ids, layout, config=config)
            assert got.shape == (t, h) and got.dtype == torch.float16
            torch.testing.assert_close(got.float(), exact, rtol=1e-2, atol=tol,
                                       msg=lambda m: f"{(h, i, t, k)} {config}: {m}")


@needs_triton
def test_interpreter_matches_fp32_math_at_any_token_count():
    run_interpreted(__file__, f"check_interpreted({json.dumps(TOKEN_CASES)})")


@needs_triton
def test_interpreter_masks_a_loop_step_past_k_and_sums_chunks_of_i():
    run_interpreted(__file__, f"check_interpreted({json.dumps(MASKED_STEP_CASES)}, down_splits=2)")


@needs_triton
def test_interpreter_gpt_oss_experts_add_their_biases_once():
    run_interpreted(__file__, f"check_interpreted({json.dumps(GPT_OSS_CASES)}, down_splits=3, gpt_oss=True, "
                              "wide=True)")


@needs_triton
@pytest.mark.parametrize("quant,dtype,h,i,takes", [
    ("int4", torch.bfloat16, 4096, 14336, True), ("int4", torch.float16, 256, 128, True),
    ("int4", torch.float32, 4096, 14336, False),  # fp32 activations: the decoded tiles
    ("int4", torch.bfloat16, 2880, 2880, False),  # gpt-oss's dims: not whole groups
    ("int4", torch.bfloat16, 256, 64, False),
    ("int4-zp-g128", torch.bfloat16, 4096, 14336, False), ("int4+q8_0", torch.bfloat16, 4096, 14336, False),
    ("none", torch.bfloat16, 4096, 14336, False),
])
def test_dispatch_takes_the_int4_kernels_for_int4_experts_only(quant, dtype, h, i, takes):
    from moe_serve.engine.experts import grouped_int4
    from moe_serve.engine.experts.grouped_experts import TILE_KERNELS, kernels_for

    x = torch.zeros(1, h, dtype=dtype)
    assert kernels_for(x, quant_layout(h, i, dtype, quant)) is (grouped_int4.KERNELS if takes else TILE_KERNELS)


@needs_triton
def test_dot_order_puts_each_column_where_the_dot_reads_it():
    from moe_serve.engine.experts.grouped_int4 import dot_order

    x = torch.arange(3 * 256, dtype=torch.float32).view(3, 256)  # two groups; each element its own index
    got = dot_order(x)
    for place in range(128):  # place 32m + 8i + 2t + p: word 4t + m, nibble i + 4p, column 32t + 8m + 4p + i
        m, i, t, p = place // 32, place // 8 % 4, place // 2 % 4, place % 2
        for group in (0, 1):
            assert torch.equal(got[:, 128 * group + place], x[:, 128 * group + 32 * t + 8 * m + 4 * p + i])


@needs_triton
def test_loop_steps_of_part_of_a_group_are_refused():
    from moe_serve.engine.experts.grouped_experts import GroupedConfig, grouped_experts

    layout, slots, x, ids, weights = grouped_problem(256, 128, 5, 2, torch.float16, "cpu", quant="int4")
    with pytest.raises(ValueError, match="whole groups of 128"):
        grouped_experts(x, weights, slots, ids, layout, config=GroupedConfig(gate_up_block_h=64))


@needs_cuda
@pytest.mark.parametrize("t", [8, 33])
def test_cuda_bf16_matches_fp32_math_and_the_torch_path(t):
    from moe_serve.engine.experts import grouped_int4
    from moe_serve.engine.experts.grouped_experts import grouped_experts, kernels_for

    layout, slots, x, ids, weights = grouped_problem(1024, 2048, t, 2, torch.bfloat16, "cuda", seed=t, quant="int4")
    assert kernels_for(x, layout) is grouped_int4.KERNELS
    exact = _exact(layout, slots, x, ids, weights)
    got = grouped_experts(x, weights, slots, ids, layout)
    assert got.dtype == torch.bfloat16 and got.shape == (t, 1024)
    # act rounds to bf16 for the down dot (2^-9 of each act summed over I), and the output rounds
    scale = exact.abs().max().item()
    torch.testing.assert_close(got.float(), exact, rtol=1.6e-2, atol=1e-2 * scale)
    # the torch path rounds each decoded weight to bf16 as well
    torch.testing.assert_close(got, gathered_experts_torch(x, weights, slots, ids, layout), rtol=5e-2,
                               atol=2e-2 * scale)
    assert torch.equal(grouped_experts(x, weights, slots, ids, layout), got)  # deterministic
    assert ids.numel() >= GROUPED_MIN_PAIRS
    assert torch.equal(gathered_experts(x, weights, slots, ids, layout), got)  # the engine's dispatch takes it
