"""The CUDA path: copy streams, per-expert events, release markers, event-timed PCIe waits.

Skipped without a GPU. Copies are slowed down on their own stream with torch.cuda._sleep (a spin
kernel), so a missing wait_event or release marker would let compute read a stale expert slot or
a copy overwrite an expert slot that compute is still reading, and the output would differ.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from moe_serve.engine.experts.cache import copy_row
from moe_serve.engine.experts.compute import accumulate_experts
from moe_serve.engine.experts.cpu_experts import ExpertCosts, profile_costs
from moe_serve.engine.experts.formats import expert_format
from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.experts.runner import CachedExpertRunner
from moe_serve.engine.experts.store import ExpertStore

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOP_K = 2
CUDA = torch.device("cuda")


def _store(layers: int, experts: int, hidden: int, inter: int) -> ExpertStore:
    layout = ExpertLayout(hidden_size=hidden, intermediate_size=inter, dtype=torch.float64)
    store = ExpertStore.for_device(layers, experts, layout, CUDA)
    gen = torch.Generator().manual_seed(0)
    store.rows.copy_(torch.randn(store.rows.shape, generator=gen, dtype=torch.float64) / hidden**0.5)
    return store


def _slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.cuda._sleep(20_000_000)  # ~10 ms of spinning on the copy stream before the copy
    copy_row(dst, src)


def _check_run(runner: CachedExpertRunner, store: ExpertStore, routers: list[torch.Tensor], tokens: int,
               steps: int) -> None:
    gen = torch.Generator(device=CUDA).manual_seed(1)
    on_gpu = store.rows.to(CUDA)  # [L, E, numel] reference weights, no cache involved
    for _ in range(steps):
        for layer in range(store.num_layers):
            x = torch.randn(tokens, store.layout.hidden_size, generator=gen, device=CUDA, dtype=torch.float64)
            probs = (x @ routers[layer].T).softmax(-1)  # [T, E]
            weights, ids = probs.topk(TOP_K, dim=-1)
            routing = LayerRouting(layer, ids, weights, probs)
            got = runner.run(x, routing)
            want = torch.zeros_like(x)
            rows = {e: on_gpu[layer, e] for e in range(store.num_experts)}
            accumulate_experts(want, x, ids, weights, rows, store.layout)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
        torch.cuda.current_stream().synchronize()  # the step's natural sync (sampled token read)
        runner.finish_step()


@pytest.mark.parametrize("policy", ["lru", "mrs"])
@pytest.mark.parametrize("prefetch", ["none", "next-layer"])
@pytest.mark.parametrize("tokens", [1, 6])
def test_cuda_output_equals_reference_with_slow_copies(policy: str, prefetch: str, tokens: int) -> None:
    store = _store(layers=4, experts=8, hidden=64, inter=32)
    routers = [torch.randn(8, 64, device=CUDA, dtype=torch.float64) for _ in range(4)]
    runner = CachedExpertRunner(store, 5 * store.layout.nbytes, policy, CUDA, top_k=TOP_K,
                                prefetch=prefetch, copy_fn=_slow_copy)
    runner.set_router_weights(routers)
    try:
        _check_run(runner, store, routers, tokens, steps=3)
    finally:
        runner.close()
    total = runner.stats().total()
    assert total.demand_bytes == total.misses * store.layout.nbytes
    assert total.pcie_wait_seconds > 0.005  # event-timed stalls on the compute stream


@pytest.mark.parametrize("tokens", [1, 6])
def test_cuda_misses_on_the_cpu_equal_reference(tokens: int) -> None:
    store = _store(layers=4, experts=8, hidden=64, inter=32)
    routers = [torch.randn(8, 64, device=CUDA, dtype=torch.float64) for _ in range(4)]
    some_on_cpu = ExpertCosts(copy_seconds=1.0, cpu_base_seconds=0.6, cpu_per_token_seconds=0.0)
    runner = CachedExpertRunner(store, 5 * store.layout.nbytes, "lru", CUDA, top_k=TOP_K, prefetch="next-layer",
                                copy_fn=_slow_copy, cpu_experts="auto", cpu_costs=some_on_cpu)
    runner.set_router_weights(routers)
    try:
        _check_run(runner, store, routers, tokens, steps=3)
    finally:
        runner.close()
    total = runner.stats().total()
    assert total.cpu_expert_computations > 0
    assert total.demand_bytes == (total.misses - total.cpu_expert_computations) * store.layout.nbytes


def test_cuda_profiled_costs_are_positive() -> None:
    costs = profile_costs(_store(layers=1, experts=4, hidden=256, inter=128), CUDA, repeats=2)
    assert costs.copy_seconds > 0 and costs.cpu_seconds(1) > 0


def test_cuda_waves_do_not_overwrite_expert_slots_compute_still_reads() -> None:
    # many tokens make each wave's compute long, so the next wave's copies would race it
    store = _store(layers=2, experts=16, hidden=512, inter=256)
    routers = [torch.randn(16, 512, device=CUDA, dtype=torch.float64) for _ in range(2)]
    runner = CachedExpertRunner(store, TOP_K * store.layout.nbytes, "lru", CUDA, top_k=TOP_K)
    runner.set_router_weights(routers)
    _check_run(runner, store, routers, tokens=2048, steps=2)
    assert runner.stats().total().waves > 2 * 2


def test_cuda_a_resident_prefill_runs_the_kernels_without_a_host_sync() -> None:
    """All experts resident: a many-token run (a prefill) goes to the in-place kernels with no sync,
    where the cache's path would read every layer's experts back to the host."""
    layout = ExpertLayout(hidden_size=64, intermediate_size=32, dtype=torch.float32)
    store = ExpertStore.for_device(2, 8, layout, CUDA)
    store.rows.copy_(torch.randn(store.rows.shape, generator=torch.Generator().manual_seed(0)) / 8)
    runner = CachedExpertRunner(store, None, "lru", CUDA, top_k=TOP_K)
    gen = torch.Generator(device=CUDA).manual_seed(1)
    try:
        assert runner.graph_safe
        for layer in range(store.num_layers):
            x = torch.randn(40, 64, generator=gen, device=CUDA)
            probs = (x @ torch.randn(8, 64, generator=gen, device=CUDA).T).softmax(-1)  # [T, E]
            weights, ids = probs.topk(TOP_K, dim=-1)
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = runner.run(x, LayerRouting(layer, ids, weights, probs))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            want = torch.zeros_like(x)
            accumulate_experts(want, x, ids, weights, {e: store.rows[layer, e].to(CUDA) for e in range(8)}, layout)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    finally:
        runner.close()
    assert runner.stats().total().hits == store.num_layers * 40 * TOP_K


@pytest.mark.parametrize("tokens", [3, 40])
def test_cuda_quantized_waves_with_slow_copies_equal_reference(tokens: int) -> None:
    """int4 experts in bf16, a cache of 4 expert slots: each wave runs the in-place kernels (40 tokens
    stream, 3 run in plain waves), the landed experts while the slowed copies of the others fly."""
    layout = ExpertLayout(hidden_size=256, intermediate_size=128, dtype=torch.bfloat16,
                          format=expert_format("int4", torch.bfloat16))
    store = ExpertStore.for_device(2, 8, layout, CUDA)
    gen = torch.Generator().manual_seed(0)
    for layer in range(2):
        store.put_fused(layer, gate_up=torch.randn(8, 256, 256, generator=gen) / 16,
                        down=torch.randn(8, 256, 128, generator=gen) / 128**0.5)
    runner = CachedExpertRunner(store, 4 * layout.nbytes, "lru", CUDA, top_k=TOP_K, copy_fn=_slow_copy)
    cuda_gen = torch.Generator(device=CUDA).manual_seed(1)
    try:
        for _ in range(2):
            for layer in range(2):
                x = torch.randn(tokens, 256, generator=cuda_gen, device=CUDA).to(torch.bfloat16)
                probs = torch.randn(tokens, 8, generator=cuda_gen, device=CUDA).softmax(-1)  # [T, E]
                # token t routes to experts 2t and 2t + 1 (mod 8): 6 or all 8 of them, more than 4 expert slots hold
                ids = (2 * torch.arange(tokens, device=CUDA)[:, None] + torch.arange(TOP_K, device=CUDA)) % 8  # [T, k]
                weights = probs.gather(1, ids)
                got = runner.run(x, LayerRouting(layer, ids, weights, probs))
                want = torch.zeros_like(x, dtype=torch.float32)
                rows = {e: store.row(layer, e).to(CUDA) for e in range(8)}
                accumulate_experts(want, x.float(), ids, weights, rows, replace(layout, dtype=torch.float32))
                torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
            torch.cuda.current_stream().synchronize()
            runner.finish_step()
    finally:
        runner.close()
    assert runner.stats().total().waves > 2 * 2
