"""The fused Triton expert kernel equals the torch gathered path it replaces.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1 must be set before the kernel
module is imported, so those cases run in a subprocess); on a GPU they are compiled, compared in
bf16, and captured in a CUDA graph. Skipped where triton is not installed.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.experts.compute import GROUPED_MIN_PAIRS, gathered_experts, gathered_experts_torch
from engine.experts.fused_experts import FusedConfig, fused_experts, fused_experts_available
from engine.experts.layout import ExpertLayout

ROOT = Path(__file__).resolve().parents[3]
# Blocks far smaller than the shapes: every kernel loops, and every edge is masked.
TINY = FusedConfig(gate_up_rows=4, gate_up_cols=8, gate_up_warps=1, down_rows=4, down_cols=8, down_warps=1)
# (H, I, T, k): odd sizes, T in {1, 3}, k in {0, 1, 2, 4}
CASES = [(37, 19, 1, 1), (37, 19, 3, 2), (16, 24, 3, 4), (40, 33, 1, 4), (24, 8, 3, 1), (21, 13, 1, 0)]
CUDA_CASES = [(256, 128, 1, 8), (256, 128, 3, 8), (200, 72, 4, 2), (2048, 1024, 1, 8)]


def _problem(h: int, i: int, t: int, k: int, dtype: torch.dtype, device: str, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    layout = ExpertLayout(hidden_size=h, intermediate_size=i, dtype=dtype)
    slots = torch.randn(5, layout.numel, generator=gen) / h**0.5  # [S, numel]
    x = torch.randn(t, h, generator=gen)  # [T, H]
    ids = torch.randint(0, 5, (t, k), generator=gen)  # [T, k]
    if k > 1:
        ids[0, -1] = ids[0, 0]  # the same slot twice in one token
    if t > 1 and k:
        ids[-1, 0] = ids[0, 0]  # and across tokens
    weights = torch.rand(t, k, generator=gen)  # [T, k]
    return layout, *(v.to(device) for v in (slots.to(dtype), x.to(dtype), ids, weights))


def check_interpreted(cases: list[tuple[int, int, int, int]]) -> None:
    """Run in the subprocess, with TRITON_INTERPRET=1: fp32 kernels on CPU tensors vs torch."""
    for h, i, t, k in cases:
        layout, slots, x, ids, weights = _problem(h, i, t, k, torch.float32, "cpu")
        expected = gathered_experts_torch(x, weights, slots, ids, layout)  # [T, H]
        for config in (TINY, None):
            got = fused_experts(x, weights, slots, ids, layout, config=config)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"{(h, i, t, k)} {config}")


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and fused_experts_available("cuda")),
                                reason="needs a CUDA device and triton")


@needs_triton
def test_interpreter_matches_torch_path():
    path = os.pathsep.join(filter(None, [str(ROOT), str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    code = f"import test_fused_experts as t; t.check_interpreted({json.dumps(CASES)})"
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]


def test_not_available_on_cpu():
    assert not fused_experts_available("cpu")
    layout, slots, x, ids, weights = _problem(16, 8, 1, 2, torch.float32, "cpu")
    torch.testing.assert_close(gathered_experts(x, weights, slots, ids, layout),
                               gathered_experts_torch(x, weights, slots, ids, layout), rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("h,i,t,k", CUDA_CASES)
def test_cuda_bf16_matches_torch_path(h, i, t, k):
    layout, slots, x, ids, weights = _problem(h, i, t, k, torch.bfloat16, "cuda")
    fp32 = ExpertLayout(h, i, torch.float32)
    exact = gathered_experts_torch(x.float(), weights, slots.float(), ids, fp32)  # fp32 math on bf16 inputs
    fused = fused_experts(x, weights, slots, ids, layout)
    assert fused.dtype == torch.bfloat16 and fused.shape == (t, h)
    torch.testing.assert_close(fused.float(), exact, rtol=1.6e-2, atol=1e-2)  # only the final cast rounds
    torch.testing.assert_close(fused, gathered_experts_torch(x, weights, slots, ids, layout), rtol=5e-2, atol=5e-2)
    if t * k < GROUPED_MIN_PAIRS:  # from there on the dispatch takes the grouped kernel (its own tests)
        assert torch.equal(gathered_experts(x, weights, slots, ids, layout), fused)


@needs_cuda
def test_cuda_graph_replays_new_inputs():
    layout, slots, x, ids, weights = _problem(256, 128, 2, 4, torch.bfloat16, "cuda")
    fused_experts(x, weights, slots, ids, layout)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_experts(x, weights, slots, ids, layout)
    _, _, x2, ids2, weights2 = _problem(256, 128, 2, 4, torch.bfloat16, "cuda", seed=1)
    for static, new in ((x, x2), (ids, ids2), (weights, weights2)):
        static.copy_(new)
    graph.replay()
    torch.testing.assert_close(captured, fused_experts(x2, weights2, slots, ids2, layout), rtol=0, atol=0)
