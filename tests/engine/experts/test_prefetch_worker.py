"""PrefetchWorker: runs concurrently with compute, never lets compute read a half-filled slot,
drops what cannot be placed or comes too late, and surfaces its failures on the compute thread."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.experts.cache import ExpertCache, copy_row
from engine.experts.policies import LRUPolicy
from engine.experts.prefetch import PrefetchTask, PrefetchWorker
from engine.experts.routing import LayerRouting
from engine.experts.runner import CachedExpertRunner

TOP_K = 2
SLOW = 0.2  # seconds a prefetch copy sleeps before writing


def _on_worker() -> bool:
    return threading.current_thread().name == "expert-prefetch"


def _routing_as_router_says(layer: int, x: torch.Tensor, weight: torch.Tensor) -> LayerRouting:
    probs = (x @ weight.T).softmax(dim=-1)  # [T, E]
    top = probs.topk(TOP_K, dim=-1)
    return LayerRouting(layer, top.indices, top.values / top.values.sum(-1, keepdim=True), probs)


def test_compute_never_reads_a_slot_before_its_slow_prefetch_landed(store, reference) -> None:
    started: set[int] = set()  # data_ptr of the store rows the worker began to copy
    progress = threading.Condition()

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if _on_worker():
            with progress:
                started.add(src.data_ptr())
                progress.notify_all()
            time.sleep(SLOW)  # the slot still holds stale bytes meanwhile
        copy_row(dst, src)

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(store.num_experts, store.layout.hidden_size, generator=gen, dtype=torch.float64)
               for _ in range(store.num_layers)]
    runner = CachedExpertRunner(store, 4 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K, copy_fn=slow_copy)
    worker = runner.prefetch_worker()
    x = torch.randn(1, store.layout.hidden_size, generator=gen, dtype=torch.float64)  # [1, H]
    routings = [_routing_as_router_says(layer, x, weights[layer]) for layer in range(store.num_layers)]
    for layer, routing in enumerate(routings):
        torch.testing.assert_close(runner.run(x, routing), reference(store, x, routing), rtol=0, atol=1e-12)
        if layer + 1 < store.num_layers:  # let the worker start on the next layer before compute gets there
            experts = routings[layer + 1].expert_ids[0]
            worker.submit(PrefetchTask(layer + 1, experts, ready=None, due=runner.layer_runs + 1))
            rows = {store.row(layer + 1, e).data_ptr() for e in experts.tolist()}
            with progress:
                assert progress.wait_for(lambda rows=rows: rows & started, timeout=5), "the next layer was never prefetched"
    runner.finish_step()
    runner.close()
    later = runner.stats().per_layer[1:]
    assert all(s.hits == TOP_K and s.misses == 0 and s.prefetch_used == TOP_K for s in later)
    # compute found the slots still in flight and waited
    assert sum(s.pcie_wait_seconds for s in later) > SLOW


def test_worker_failure_surfaces_on_the_compute_thread(store, make_routing) -> None:
    def failing_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if _on_worker():
            raise OSError("DMA engine on fire")
        copy_row(dst, src)

    runner = CachedExpertRunner(store, 4 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K, copy_fn=failing_copy)
    runner.prefetch_worker().submit(PrefetchTask(1, torch.tensor([3, 4]), ready=None, due=10))
    with pytest.raises(RuntimeError, match="prefetch worker failed") as failure:
        runner.wait_prefetch_idle()
    assert isinstance(failure.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="prefetch worker failed"):
        runner.finish_step()
    with pytest.raises(RuntimeError, match="prefetch worker failed"):
        runner.close()


def test_failed_prefetch_is_forgotten_not_served(store) -> None:
    broken = threading.Event()
    broken.set()

    def flaky_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if broken.is_set():
            raise OSError("bad copy")
        copy_row(dst, src)

    cache = ExpertCache(store, 4 * store.layout.nbytes, LRUPolicy(), "cpu", top_k=TOP_K, copy_fn=flaky_copy)
    with pytest.raises(OSError):
        cache.prefetch(0, [3])
    broken.clear()
    wave = cache.acquire(0, [3])  # the failed copy is dropped, then copied on demand
    assert not wave.rows(landed=True) and list(wave.pending) == [3]
    cache.wait_pending(wave)
    assert torch.equal(wave.rows(landed=False)[3], store.row(0, 3))
    cache.release(wave)
    assert cache.stats.snapshot().per_layer[0].misses == 1


def test_no_free_slot_drops_the_rest_of_the_task(store) -> None:
    cache = ExpertCache(store, 2 * store.layout.nbytes, LRUPolicy(), "cpu", top_k=TOP_K)
    wave = cache.acquire(0, [0, 1])  # both slots pinned by compute
    cache.prefetch(1, [4, 5])
    cache.release(wave)
    cache.prefetch(1, [4, 5, 6])  # two slots free up, the third expert has none
    layer1 = cache.stats.snapshot().per_layer[1]
    assert (layer1.prefetch_dropped, layer1.prefetch_bytes) == (3, 2 * store.layout.nbytes)
    assert cache.stats.snapshot().per_layer[0].evictions == 2


def test_stale_tasks_are_skipped_and_ready_events_are_awaited(store) -> None:
    cache = ExpertCache(store, 4 * store.layout.nbytes, LRUPolicy(), "cpu", top_k=TOP_K)
    progress = 5
    worker = PrefetchWorker(cache, lambda: progress)
    worker.submit(PrefetchTask(layer=2, experts=torch.tensor([1, 2]), ready=None, due=5))
    worker.submit(PrefetchTask(layer=3, experts=torch.tensor([6, -1]), ready=None, due=6))
    worker.wait_idle()
    worker.close()
    per_layer = cache.stats.snapshot().per_layer
    assert (per_layer[2].prefetch_stale, per_layer[2].prefetch_bytes) == (1, 0)
    assert (per_layer[3].prefetch_stale, per_layer[3].prefetch_bytes) == (0, store.layout.nbytes)
    assert cache.resident_experts == 1
