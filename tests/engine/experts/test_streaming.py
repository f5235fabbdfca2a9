"""Prefill streaming: the math never changes, the counters add up, and the copies are issued early.

The ordering tests record, on the CPU, the order in which the runner issues expert copies (an
injected copy_fn) and expert compute (accumulate_experts): on a GPU both are enqueued in that
order on their streams, so "issued before" is what lets a copy fly while compute runs.
"""
from __future__ import annotations

import pytest
import torch
from runner_harness import drive, router_weights

from moe_serve.engine.experts import runner as runner_module
from moe_serve.engine.experts.cache import copy_row
from moe_serve.engine.experts.compute import accumulate_experts
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.experts.runner import CachedExpertRunner
from moe_serve.engine.experts.streaming import streams

TOP_K = 2
TOKENS = 16  # T·k = 32 ≥ 2E = 16 for the 8-expert test store: streamed


def _routed_by(weights: torch.Tensor, layer: int, x: torch.Tensor) -> LayerRouting:
    """The routing layer `layer`'s router gives x: what the stream's gate guess predicts exactly."""
    probs = (x @ weights.T).softmax(-1)  # [T, E]
    top = probs.topk(TOP_K, dim=-1)
    return LayerRouting(layer, top.indices, top.values / top.values.sum(-1, keepdim=True), probs, normalize=True)


class _Log:
    """The order of copies ('copy', layer, expert) and compute calls ('compute', layer, experts)."""

    def __init__(self, store, monkeypatch) -> None:
        self.events: list[tuple] = []
        self._keys = {store.row(l, e).data_ptr(): (l, e)
                      for l in range(store.num_layers) for e in range(store.num_experts)}
        self._layer = -1

        def compute(out, x, ids, weights, rows, layout) -> None:
            self.events.append(("compute", self._layer, frozenset(rows)))
            accumulate_experts(out, x, ids, weights, rows, layout)

        monkeypatch.setattr(runner_module, "accumulate_experts", compute)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.events.append(("copy", *self._keys[src.data_ptr()]))
        copy_row(dst, src)

    def run(self, runner: CachedExpertRunner, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        self._layer = routing.layer
        self.events.append(("run", routing.layer))  # the layer's read-back comes after this
        return runner.run(x, routing)


def test_streams_once_the_tokens_pick_every_expert_twice_over() -> None:
    assert streams(8, 2, 8) and not streams(7, 2, 8)  # Mixtral-like: E=8, k=2
    assert streams(16, 8, 64) and not streams(15, 8, 64)  # OLMoE-like: E=64, k=8
    assert not streams(1, 8, 64)  # decode never streams


@pytest.mark.parametrize("policy", ["lru", "lfu", "mrs"])
@pytest.mark.parametrize("prefetch", ["none", "next-layer"])
@pytest.mark.parametrize("slots", [2, 3, 5, 12, 32], ids=lambda s: f"{s}slots")
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_streamed_forward_equals_all_experts_reference(store, make_routing, reference, policy, prefetch, slots,
                                                        stream) -> None:
    """Random routings (the guess is often wrong) at budgets from one wave per layer down to
    double-buffered waves of one expert; 32 slots hold every expert (nothing to stream)."""
    runner = CachedExpertRunner(store, slots * store.layout.nbytes, policy, "cpu", top_k=TOP_K, prefetch=prefetch,
                                stream_prefill=stream)
    runner.set_router_weights(router_weights(store))
    try:
        accesses = drive(runner, store, make_routing, reference, steps=3, tokens=TOKENS, top_k=TOP_K, seed=7)
    finally:
        runner.close()
    total = runner.stats().total()
    prefetched = total.prefetch_bytes // store.layout.nbytes
    assert total.hits + total.misses == accesses
    assert total.demand_bytes == total.misses * store.layout.nbytes
    assert total.prefetch_used + total.prefetch_wasted <= prefetched
    assert total.prefetch_used <= total.hits
    assert runner.resident_experts <= slots
    assert not any(runner.cache._table.is_pinned((l, e))  # every wave was released
                   for l in range(store.num_layers) for e in range(store.num_experts))
    if slots == 32:
        assert total.misses == 0 and prefetched == 0
    elif stream:
        assert prefetched > 0 and total.prefetch_used > 0  # streamed copies count as prefetches
    elif prefetch == "none":
        assert prefetched == 0


def test_next_layer_copies_are_issued_after_the_layers_compute_and_before_the_next_read_back(
        store, monkeypatch) -> None:
    weights = router_weights(store)
    log = _Log(store, monkeypatch)
    runner = CachedExpertRunner(store, 12 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K, copy_fn=log.copy)
    runner.set_router_weights(weights)
    x = torch.randn(TOKENS, store.layout.hidden_size, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    try:
        log.run(runner, x, _routed_by(weights[0], 0, x))
        log.run(runner, x, _routed_by(weights[1], 1, x))  # routed as the stream guessed
    finally:
        runner.close()
    events = log.events
    next_run = events.index(("run", 1))
    last_compute = max(i for i, e in enumerate(events[:next_run]) if e[0] == "compute")
    layer1_copies = [i for i, e in enumerate(events) if e[:2] == ("copy", 1)]
    assert layer1_copies and all(last_compute < i < next_run for i in layer1_copies)
    layer1 = runner.stats().per_layer[1]
    used = len({e for row in _routed_by(weights[1], 1, x).expert_ids.tolist() for e in row})
    assert (layer1.hits, layer1.misses, layer1.prefetch_used) == (used, 0, used)
    assert layer1.prefetch_bytes == used * store.layout.nbytes  # the guess was exactly the routing
    assert runner.stats().per_layer[0].prefetch_bytes == 0  # nothing streams into the first layer


def test_a_short_span_does_not_stream(store, make_routing, monkeypatch) -> None:
    runner = CachedExpertRunner(store, 12 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    runner.set_router_weights(router_weights(store))
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(7, store.layout.hidden_size, generator=gen, dtype=torch.float64)  # T·k = 14 < 2E
    try:
        runner.run(x, make_routing(0, 7, store.num_experts, TOP_K, gen))
    finally:
        runner.close()
    assert runner.stats().total().prefetch_bytes == 0


def test_a_layer_that_overflows_the_cache_copies_the_next_wave_before_computing_this_one(
        store, make_routing, monkeypatch) -> None:
    log = _Log(store, monkeypatch)
    slots = 4
    runner = CachedExpertRunner(store, slots * store.layout.nbytes, "lru", "cpu", top_k=TOP_K, copy_fn=log.copy)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(TOKENS, store.layout.hidden_size, generator=gen, dtype=torch.float64)
    routing = make_routing(0, TOKENS, store.num_experts, TOP_K, gen)
    needed = set(routing.expert_ids.unique().tolist())
    assert len(needed) > slots
    try:
        log.run(runner, x, routing)
    finally:
        runner.close()
    computed: set[int] = set()
    for i, event in enumerate(log.events):
        if event[0] != "compute":
            continue
        computed |= event[2]
        copied = {e[2] for e in log.events[:i] if e[0] == "copy"}
        # the next wave (half the cache, or what is left) is already being copied
        assert len(copied - computed) == min(slots // 2, len(needed - computed))
    assert computed == needed
    assert runner.stats().per_layer[0].waves == -(-len(needed) // (slots // 2))


def test_a_failing_compute_releases_every_pinned_wave(store, make_routing, monkeypatch) -> None:
    runner = CachedExpertRunner(store, 4 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    calls = []

    def fail_on_second(out, x, ids, weights, rows, layout) -> None:
        calls.append(rows)
        if len(calls) == 2:
            raise RuntimeError("compute failed")
        accumulate_experts(out, x, ids, weights, rows, layout)

    monkeypatch.setattr(runner_module, "accumulate_experts", fail_on_second)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(TOKENS, store.layout.hidden_size, generator=gen, dtype=torch.float64)
    try:
        with pytest.raises(RuntimeError, match="compute failed"):
            runner.run(x, make_routing(0, TOKENS, store.num_experts, TOP_K, gen))
    finally:
        runner.close()
    assert not any(runner.cache._table.is_pinned((0, e)) for e in range(store.num_experts))
