"""ExpertCache: capacity from a budget, the too-small-budget error, expert slots hold the store's rows."""
from __future__ import annotations

import threading

import pytest
import torch

from moe_serve.engine.experts.cache import ExpertCache, cache_capacity
from moe_serve.engine.experts.policies import LRUPolicy


def test_capacity_from_bytes_fraction_or_all() -> None:
    assert cache_capacity(None, total_experts=32, expert_bytes=100, top_k=2) == 32
    assert cache_capacity(0.25, total_experts=32, expert_bytes=100, top_k=2) == 8
    assert cache_capacity(1050, total_experts=32, expert_bytes=100, top_k=2) == 10
    assert cache_capacity(10**9, total_experts=32, expert_bytes=100, top_k=2) == 32  # never above all experts


def test_budget_below_top_k_experts_states_the_minimum() -> None:
    expert_bytes = 3 * 2**28  # 0.75 GiB
    with pytest.raises(ValueError, match=r"top_k=2 .*minimum budget is 1610612736 bytes \(1\.500 GiB\)"):
        cache_capacity(2**30, total_experts=64, expert_bytes=expert_bytes, top_k=2)
    with pytest.raises(ValueError, match="minimum budget is 200 bytes"):
        cache_capacity(0.01, total_experts=64, expert_bytes=100, top_k=2)


def test_acquired_rows_equal_store_rows_and_evictions_follow_lru(store) -> None:
    cache = ExpertCache(store, store.layout.nbytes * 3, LRUPolicy(), "cpu", top_k=2)
    assert cache.capacity == 3 and cache.resident_experts == 0
    for layer, experts in ((0, [1, 2]), (1, [3]), (0, [1, 5])):
        wave = cache.acquire(layer, experts)
        assert not wave.leftover
        cache.wait_pending(wave)
        rows = {**wave.rows(landed=True), **wave.rows(landed=False)}
        assert sorted(rows) == experts
        assert all(torch.equal(r, store.row(layer, e)) for e, r in rows.items())
        cache.release(wave)
    per_layer = cache.stats.snapshot().per_layer
    # (0, 2) is the LRU expert when (0, 5) comes in; (0, 1) is a hit
    assert (per_layer[0].hits, per_layer[0].misses, per_layer[0].evictions) == (1, 3, 1)
    assert per_layer[0].demand_bytes == 3 * store.layout.nbytes
    assert cache.resident_experts == 3


def test_all_experts_budget_is_preloaded(store) -> None:
    cache = ExpertCache(store, None, LRUPolicy(), "cpu", top_k=2)
    wave = cache.acquire(2, list(range(store.num_experts)))
    assert not wave.pending and all(torch.equal(r, store.row(2, e)) for e, r in wave.rows(landed=True).items())
    cache.release(wave)
    total = cache.stats.snapshot().total()
    assert (total.hits, total.misses, total.demand_bytes) == (store.num_experts, 0, 0)


def test_wave_when_more_experts_than_expert_slots(store) -> None:
    cache = ExpertCache(store, store.layout.nbytes * 2, LRUPolicy(), "cpu", top_k=2)
    first = cache.acquire(0, [0, 1, 2, 3, 4])
    assert len(first.pending) == 2 and first.leftover == [2, 3, 4]
    cache.wait_pending(first)
    cache.release(first)
    second = cache.acquire(0, first.leftover)
    assert list(second.pending) == [2, 3] and second.leftover == [4]
    cache.release(second)


def test_whole_acquire_waits_for_in_flight_copies_instead_of_splitting(store) -> None:
    """A replayed graph computes all of a layer's experts at once: no second wave may be left."""
    landed = threading.Event()

    def slow_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        landed.wait(timeout=10)
        dst.copy_(src)

    cache = ExpertCache(store, store.layout.nbytes * 2, LRUPolicy(), "cpu", top_k=2, copy_fn=slow_copy)
    # a thread stands in for an asynchronous copy engine: the prefetch holds one expert slot while in flight
    prefetcher = threading.Thread(target=cache.prefetch, args=([(1, 0)],))
    prefetcher.start()
    while cache.resident_experts == 0:
        threading.Event().wait(0.001)
    timer = threading.Timer(0.2, landed.set)
    timer.start()
    wave = cache.acquire(0, [3, 4], whole=True)
    prefetcher.join()
    assert wave.leftover == [] and sorted(wave.expert_slots) == [3, 4]
    cache.wait_pending(wave)
    assert all(torch.equal(r, store.row(0, e)) for e, r in wave.rows(landed=False).items())
    cache.release(wave)


def test_failed_prefetch_is_forgotten_not_served(store) -> None:
    broken = threading.Event()
    broken.set()

    def flaky_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        if broken.is_set():
            raise OSError("bad copy")
        dst.copy_(src)

    cache = ExpertCache(store, 4 * store.layout.nbytes, LRUPolicy(), "cpu", top_k=2, copy_fn=flaky_copy)
    with pytest.raises(OSError):
        cache.prefetch([(0, 3)])
    broken.clear()
    wave = cache.acquire(0, [3])  # the failed copy is dropped, then copied on demand
    assert not wave.rows(landed=True) and list(wave.pending) == [3]
    cache.wait_pending(wave)
    assert torch.equal(wave.rows(landed=False)[3], store.row(0, 3))
    cache.release(wave)
    assert cache.stats.snapshot().per_layer[0].misses == 1


def test_a_prefetch_without_free_expert_slots_drops_the_rest(store) -> None:
    cache = ExpertCache(store, 2 * store.layout.nbytes, LRUPolicy(), "cpu", top_k=2)
    wave = cache.acquire(0, [0, 1])  # both expert slots pinned by compute
    cache.prefetch([(1, 4), (1, 5)])
    cache.release(wave)
    cache.prefetch([(1, 4), (1, 5), (1, 6)])  # two expert slots free up, the third expert has none
    layer1 = cache.stats.snapshot().per_layer[1]
    assert (layer1.prefetch_dropped, layer1.prefetch_bytes) == (3, 2 * store.layout.nbytes)
    assert cache.stats.snapshot().per_layer[0].evictions == 2


def test_a_prefetch_within_room_takes_no_kept_expert_slot_and_drops_nothing(store) -> None:
    """A streamed layer's tail fills what its released waves free and asks again after the next."""
    cache = ExpertCache(store, 3 * store.layout.nbytes, LRUPolicy(), "cpu", top_k=2)
    kept, streamed = cache.acquire(0, [0]), cache.acquire(0, [1, 2])
    cache.keep(0, [0])
    cache.release(kept)
    cache.prefetch([(1, 4), (1, 5)], within_room=True)  # (0, 0) is kept, the others pinned: no room
    cache.release(streamed)
    cache.prefetch([(1, 4), (1, 5), (1, 6)], within_room=True)
    layers = cache.stats.snapshot().per_layer
    assert (layers[1].prefetch_bytes, layers[1].prefetch_dropped) == (2 * store.layout.nbytes, 0)
    assert cache.missing(0, [0, 1, 2]) == [1, 2] and cache.missing(1, [4, 5, 6]) == [6]


def test_one_prefetch_over_several_layers_books_each_layer(store) -> None:
    cache = ExpertCache(store, 4 * store.layout.nbytes, LRUPolicy(), "cpu", top_k=2)
    cache.prefetch([(0, 1), (1, 2), (1, 3)])
    layers = cache.stats.snapshot().per_layer
    assert [layers[0].prefetch_bytes, layers[1].prefetch_bytes] == [store.layout.nbytes, 2 * store.layout.nbytes]
    wave = cache.acquire(1, [2, 3])
    assert sorted(wave.rows(landed=True)) == [2, 3]  # prefetched: hits, nothing pending
    cache.release(wave)
