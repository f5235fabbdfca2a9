"""Prefill streaming: the math never changes, the counters add up, and the copies are issued early.

The ordering tests record, on the CPU, the order in which the runner issues expert copies (an
injected copy_fn) and expert compute (accumulate_experts): on a GPU both are enqueued in that
order on their streams, so "issued before" is what lets a copy fly while compute runs.
"""
from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from runner_harness import drive, router_weights

from moe_serve.engine.experts import runner as runner_module
from moe_serve.engine.experts.cache import copy_row
from moe_serve.engine.experts.compute import accumulate_experts
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.experts.runner import CachedExpertRunner
from moe_serve.engine.experts.streaming import saturates, streams

TOP_K = 2
TOKENS = 16  # T·k = 32 ≥ 2E = 16 for the 8-expert test store: streamed
# The batch benchmark's model (6 MoE layers x 8 experts, top-2, Mixtral-size experts) at a 25%
# budget: 12 expert slots. Its experts stream one a wave; these small ones do too with min_wave_bytes=0.
BENCH_LAYERS, BENCH_EXPERT_SLOTS, BATCH = 6, 12, 32


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
@pytest.mark.parametrize("expert_slots", [2, 3, 5, 12, 32], ids=lambda s: f"{s}-expert-slots")
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "no-stream"])
def test_streamed_forward_equals_all_experts_reference(store, make_routing, reference, policy, prefetch,
                                                        expert_slots, stream) -> None:
    """Random routings (the guess is often wrong) at budgets from one wave per layer down to
    double-buffered waves of one expert; 32 expert slots hold every expert (nothing to stream)."""
    runner = CachedExpertRunner(store, expert_slots * store.layout.nbytes, policy, "cpu", top_k=TOP_K,
                                prefetch=prefetch, stream_prefill=stream)
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
    assert runner.resident_experts <= expert_slots
    assert not any(runner.cache._table.is_pinned((l, e))  # every wave was released
                   for l in range(store.num_layers) for e in range(store.num_experts))
    if expert_slots == 32:
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
    expert_slots = 4
    runner = CachedExpertRunner(store, expert_slots * store.layout.nbytes, "lru", "cpu", top_k=TOP_K, copy_fn=log.copy)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(TOKENS, store.layout.hidden_size, generator=gen, dtype=torch.float64)
    routing = make_routing(0, TOKENS, store.num_experts, TOP_K, gen)
    needed = set(routing.expert_ids.unique().tolist())
    assert len(needed) > expert_slots
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
        assert len(copied - computed) == min(expert_slots // 2, len(needed - computed))
    assert computed == needed
    assert runner.stats().per_layer[0].waves == -(-len(needed) // (expert_slots // 2))


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


def test_a_span_saturates_once_fewer_than_one_expert_of_the_model_is_expected_unused() -> None:
    assert saturates(14, 2, 8, 6) and not saturates(13, 2, 8, 6)  # the benchmark's model
    assert saturates(52, 8, 64, 16) and not saturates(51, 8, 64, 16)  # OLMoE-like


def _bench_runner(store, policy: str = "lru", **kwargs) -> CachedExpertRunner:
    runner = CachedExpertRunner(store, BENCH_EXPERT_SLOTS * store.layout.nbytes, policy, "cpu", top_k=TOP_K,
                                min_wave_bytes=0, **kwargs)
    runner.set_router_weights(router_weights(store))
    return runner


def _saturated_steps(runner, store, make_routing, reference, steps: int) -> list[int]:
    """Decode steps of BATCH sequences that need every expert of every layer, outputs compared with
    the all-resident reference (runner_harness.drive); the experts copied (demand or prefetch) per step."""
    def every_expert(layer: int, tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> LayerRouting:
        while True:
            routing = make_routing(layer, tokens, num_experts, top_k, gen)
            if routing.expert_ids.unique().numel() == num_experts:
                return routing

    def copied() -> int:
        total = runner.stats().total()
        return (total.demand_bytes + total.prefetch_bytes) // store.layout.nbytes

    per_step = []
    for step in range(steps):
        before = copied()
        drive(runner, store, every_expert, reference, steps=1, tokens=BATCH, top_k=TOP_K, seed=100 + step)
        per_step.append(copied() - before)
    return per_step


@pytest.mark.parametrize("policy", ["lru", "next-use"])
def test_saturated_steps_keep_ten_experts_resident_and_copy_the_other_38_once_a_step(
        make_store, make_routing, reference, policy) -> None:
    """Issue G's goal 2: at most 40 of the 48 experts copied per saturated step, whatever the policy.
    Every step needs all 48 and 2 expert slots stream, so the other 10 stay (Belady's rule on the
    cycle); streamed without keeping (experts too small to keep any), LRU copies all 48 every step."""
    store = make_store(num_layers=BENCH_LAYERS)
    runner = _bench_runner(store, policy)
    try:
        per_step = _saturated_steps(runner, store, make_routing, reference, steps=5)
    finally:
        runner.close()
    assert per_step[1:] == [38] * 4  # the first step fills the cache
    assert runner.cache.kept == BENCH_EXPERT_SLOTS - 2
    total = runner.stats().total()
    assert total.prefetch_wasted == 0 and total.prefetch_used == total.prefetch_bytes // store.layout.nbytes
    assert not any(runner.cache._table.is_pinned((l, e))
                   for l in range(store.num_layers) for e in range(store.num_experts))
    if policy == "lru":
        unkept = CachedExpertRunner(store, BENCH_EXPERT_SLOTS * store.layout.nbytes, policy, "cpu", top_k=TOP_K)
        unkept.set_router_weights(router_weights(store))
        try:
            assert _saturated_steps(unkept, store, make_routing, reference, steps=3)[1:] == [48, 48]
        finally:
            unkept.close()


def test_a_saturated_step_computes_kept_experts_first_and_always_has_a_copy_in_flight(
        make_store, make_routing, reference, monkeypatch) -> None:
    """On the GPU the link idles while a wave computes unless a copy that wave does not wait for
    was issued before it. Each layer run computes its kept experts first; every wave after them
    was being copied before the wave before it computed; the next layer's experts are copied
    before this layer's last wave computes. Only the step's last layer has no next one to copy."""
    store = make_store(num_layers=BENCH_LAYERS)
    log = _Log(store, monkeypatch)
    runner = _bench_runner(store, copy_fn=log.copy)
    try:
        logged = SimpleNamespace(run=lambda x, routing: log.run(runner, x, routing), finish_step=runner.finish_step,
                                 stats=runner.stats)
        _saturated_steps(logged, store, make_routing, reference, steps=2)
        log.events.clear()
        _saturated_steps(logged, store, make_routing, reference, steps=1)
        kept = {l: {e for e in range(store.num_experts) if runner.cache.is_kept(l, e)} for l in range(store.num_layers)}
    finally:
        runner.close()
    computes = [i for i, e in enumerate(log.events) if e[0] == "compute"]
    for layer in range(store.num_layers):
        first = next(i for i in computes if log.events[i][1] == layer)
        assert log.events[first][2] == kept[layer]
    in_flight: set[tuple[int, int]] = set()
    for event in log.events[: computes[-1]]:
        if event[0] == "copy":
            in_flight.add(event[1:])
        elif event[0] == "compute":
            in_flight -= {(event[1], e) for e in event[2]}
            assert in_flight, event
    copies = sum(e[0] == "copy" for e in log.events)
    assert copies == 38


def test_a_span_that_needs_every_expert_streams_instead_of_replaying(make_store) -> None:
    store = make_store(num_layers=BENCH_LAYERS)
    runner = _bench_runner(store)
    small = CachedExpertRunner(store, BENCH_EXPERT_SLOTS * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    unstreamed = _bench_runner(store, stream_prefill=False)
    try:
        assert runner.can_replay(1) and runner.can_replay(13) and not runner.can_replay(14)
        assert not runner.can_replay(BATCH)
        assert small.can_replay(BATCH)  # experts this small: the stream keeps none, replays lose nothing
        assert unstreamed.can_replay(BATCH)
    finally:
        for r in (runner, small, unstreamed):
            r.close()


def test_a_short_span_after_saturated_steps_may_take_any_expert_slot(make_store, make_routing, reference) -> None:
    """A replayed layer must hold all its experts in one wave: nothing stays kept for it."""
    from moe_serve.engine.experts.compute import gathered_experts

    store = make_store(num_layers=BENCH_LAYERS)
    runner = _bench_runner(store)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(4, store.layout.hidden_size, generator=gen, dtype=torch.float64)  # [T, H]
    routing = make_routing(0, 4, store.num_experts, TOP_K, gen)
    try:
        _saturated_steps(runner, store, make_routing, reference, steps=2)
        assert runner.cache.kept == BENCH_EXPERT_SLOTS - 2
        with runner.capturing(lambda: None) as layers:
            runner.run(x, routing)
        runner.replay_layer(layers[0])
        assert runner.cache.kept == 0
        out = gathered_experts(x, routing.expert_weights, runner.cache.expert_slots, layers[0].index[0], store.layout)
        runner.finish_replay()
    finally:
        runner.close()
    torch.testing.assert_close(out, reference(store, x, routing), rtol=0, atol=1e-12)


@pytest.mark.parametrize("policy", ["lru", "next-use"])
@pytest.mark.parametrize("prefetch", ["none", "next-layer"])
def test_decode_and_verify_spans_copy_what_they_copied_without_kept_experts(
        make_store, make_routing, reference, policy, prefetch) -> None:
    """Spans too short to stream (one token, a verify pass of 3) never keep: every counter is the
    same as for a runner whose experts are too small to keep any."""
    store = make_store(num_layers=BENCH_LAYERS)
    snapshots = []
    for min_wave_bytes in (0, 2**40):
        runner = CachedExpertRunner(store, BENCH_EXPERT_SLOTS * store.layout.nbytes, policy, "cpu", top_k=TOP_K,
                                    prefetch=prefetch, min_wave_bytes=min_wave_bytes)
        runner.set_router_weights(router_weights(store))
        try:
            for tokens in (1, 3):
                drive(runner, store, make_routing, reference, steps=4, tokens=tokens, top_k=TOP_K, seed=13)
        finally:
            runner.close()
        snapshots.append([replace(layer, pcie_wait_seconds=0.0) for layer in runner.stats().per_layer])  # a timing
    assert snapshots[0] == snapshots[1]
    assert sum(layer.misses for layer in snapshots[0]) > 0
