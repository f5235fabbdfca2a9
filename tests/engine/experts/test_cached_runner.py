"""CachedExpertRunner: caching never changes the math; counters add up."""
from __future__ import annotations

import threading
from contextlib import ExitStack
from unittest import mock

import pytest
import torch
from runner_harness import drive, router_weights

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.experts.cache import copy_row
from moe_serve.engine.experts.compute import accumulate_experts
from moe_serve.engine.experts.formats import expert_format
from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.experts.runner import CachedExpertRunner, layer_scores
from moe_serve.engine.experts.store import ExpertStore
from tests.triton_interpreter import needs_triton, run_interpreted

TOP_K = 2


@pytest.mark.parametrize("policy", ["lru", "lfu", "mrs"])
@pytest.mark.parametrize("prefetch", ["none", "next-layer"])
@pytest.mark.parametrize("expert_slots,tokens", [(10, 1), (10, 3), (3, 4)], ids=["decode", "verify", "waves"])
def test_output_equals_all_experts_reference(store, make_routing, reference, policy, prefetch, expert_slots,
                                            tokens) -> None:
    runner = CachedExpertRunner(store, expert_slots * store.layout.nbytes, policy, "cpu", top_k=TOP_K,
                                prefetch=prefetch, prefetch_depth=2)
    runner.set_router_weights(router_weights(store))
    try:
        accesses = drive(runner, store, make_routing, reference, steps=4, tokens=tokens, top_k=TOP_K)
    finally:
        runner.close()
    total = runner.stats().total()
    assert total.hits + total.misses == accesses
    assert total.demand_bytes == total.misses * store.layout.nbytes
    assert total.prefetch_bytes % store.layout.nbytes == 0
    assert total.waves >= 4 * store.num_layers
    assert total.prefetch_used + total.prefetch_wasted <= total.prefetch_bytes // store.layout.nbytes
    assert runner.resident_experts <= expert_slots
    if prefetch == "none":
        assert total.prefetch_bytes == 0 and total.predicted_needed == 0


def test_waves_when_a_layer_needs_more_experts_than_the_cache_holds(store, make_routing, reference) -> None:
    runner = CachedExpertRunner(store, 2 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, store.layout.hidden_size, generator=gen, dtype=torch.float64)
    routing = make_routing(0, 8, store.num_experts, TOP_K, gen)
    torch.testing.assert_close(runner.run(x, routing), reference(store, x, routing), rtol=0, atol=1e-12)
    distinct = routing.expert_ids.unique().numel()
    layer0 = runner.stats().per_layer[0]
    assert layer0.waves == distinct and layer0.misses == distinct  # double-buffered: half the cache a wave
    assert layer0.evictions == distinct - 2


def test_repeated_routing_hits_and_counts_wait_time(store, make_routing) -> None:
    runner = CachedExpertRunner(store, 4 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, store.layout.hidden_size, generator=gen, dtype=torch.float64)
    routing = make_routing(1, 1, store.num_experts, TOP_K, gen)
    runner.run(x, routing)
    runner.run(x, routing)
    runner.finish_step()
    layer1 = runner.stats().per_layer[1]
    assert (layer1.misses, layer1.hits, layer1.evictions) == (TOP_K, TOP_K, 0)
    assert layer1.pcie_wait_seconds > 0


def test_next_layer_prefetch_turns_misses_into_hits(store, make_routing) -> None:
    weights = router_weights(store)
    copied_on: set[str] = set()

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        copied_on.add(threading.current_thread().name)
        copy_row(dst, src)

    runner = CachedExpertRunner(store, 6 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K, prefetch="next-layer",
                                copy_fn=copy)
    runner.set_router_weights(weights)
    x = torch.randn(1, store.layout.hidden_size, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    gen = torch.Generator().manual_seed(6)
    runner.run(x, make_routing(0, 1, store.num_experts, TOP_K, gen))
    # prefetched by the run itself on the compute thread: no second thread contends for the GIL
    assert copied_on == {threading.current_thread().name}
    # layer 1 routes exactly as its router says for this x: the predictor's guess is right
    probs = (x @ weights[1].T).softmax(-1)  # [1, E]
    top = probs.topk(TOP_K, dim=-1)
    runner.run(x, type(make_routing(1, 1, store.num_experts, TOP_K, gen))(
        layer=1, expert_ids=top.indices, expert_weights=top.values, router_probs=probs))
    runner.close()
    layer1 = runner.stats().per_layer[1]
    assert (layer1.hits, layer1.misses, layer1.prefetch_used) == (TOP_K, 0, TOP_K)
    assert (layer1.predicted_correct, layer1.predicted_needed) == (TOP_K, TOP_K)
    assert layer1.prefetch_bytes == TOP_K * store.layout.nbytes


def test_prefetch_without_router_weights_fails_loudly(store, make_routing) -> None:
    runner = CachedExpertRunner(store, None, "lru", "cpu", top_k=TOP_K, prefetch="next-layer")
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(RuntimeError, match="set_router_weights"):
        runner.run(torch.zeros(1, store.layout.hidden_size, dtype=torch.float64),
                   make_routing(0, 1, store.num_experts, TOP_K, gen))
    runner.close()


def test_from_config_parses_budget_and_rejects_unknown_modes(store) -> None:
    config = EngineConfig(model="m", gpu_expert_budget="25%", cache_policy="mrs")
    runner = CachedExpertRunner.from_config(store, config, top_k=TOP_K)
    assert runner.cache.capacity == store.num_layers * store.num_experts // 4
    with pytest.raises(ValueError, match="none, next-layer"):
        CachedExpertRunner(store, None, "lru", "cpu", top_k=TOP_K, prefetch="draft")


def test_layer_scores_keep_each_tokens_top_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    expected = torch.tensor([0.5 + 0.0, 0.3 + 0.0, 0.0 + 0.3, 0.0 + 0.4]) / 2
    torch.testing.assert_close(layer_scores(probs, top_p=2), expected)


def _draft_routing(layer: int, probs: torch.Tensor, r: int) -> LayerRouting:
    """A self-draft's routing as MoEBlock makes it: the best r, and the whole top-k as candidates."""
    top = probs.topk(TOP_K, dim=-1)
    weights = top.values[:, :r] / top.values[:, :r].sum(-1, keepdim=True)
    return LayerRouting(layer, top.indices[:, :r], weights, probs, top.indices, normalize=True)


def test_a_self_draft_runs_resident_experts_of_its_top_k_first(store, reference) -> None:
    runner = CachedExpertRunner(store, 4 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, store.layout.hidden_size, generator=gen, dtype=torch.float64)  # [T, H]
    probs = torch.zeros(2, store.num_experts, dtype=torch.float64)
    probs[0, [3, 5]] = torch.tensor([0.6, 0.4], dtype=torch.float64)  # token 0: 3 best, only 5 resident
    probs[1, [1, 6]] = torch.tensor([0.7, 0.3], dtype=torch.float64)  # token 1: 1 best and resident
    try:
        runner.run(x, LayerRouting(0, torch.tensor([[5], [1]]), torch.ones(2, 1, dtype=torch.float64), probs))
        before = runner.stats().total()
        out = runner.run(x, _draft_routing(0, probs, r=1))
        after = runner.stats().total()
    finally:
        runner.close()
    assert (after.hits - before.hits, after.misses - before.misses) == (2, 0)  # expert 3 was not copied
    ran = LayerRouting(0, torch.tensor([[5], [1]]), torch.ones(2, 1, dtype=torch.float64), probs)  # renormalised
    torch.testing.assert_close(out, reference(store, x, ran), rtol=0, atol=1e-12)


def test_piecewise_capture_then_replay_hands_the_next_segment_resident_expert_slots(store, reference) -> None:
    """The host half of a piecewise-graphed step (moe_serve/engine/graphs.py), run on the CPU: capturing packs
    the routing and counts nothing; replaying a layer makes its experts resident in one wave and
    writes their expert slots and ids where the next segment's expert compute reads them."""
    from moe_serve.engine.experts.compute import gathered_experts

    runner = CachedExpertRunner(store, 3 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    x = torch.randn(1, store.layout.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    probs = torch.zeros(1, store.num_experts, dtype=torch.float64)
    probs[0, [6, 2]] = torch.tensor([0.7, 0.3], dtype=torch.float64)
    splits = []
    try:
        runner.run(x, LayerRouting(1, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.float64), probs))  # 2 resident
        before = runner.stats().total()
        with runner.capturing(lambda: splits.append(len(splits))) as layers:
            routing = _draft_routing(1, probs, r=1)
            runner.run(x, routing)
        assert splits == [0] and [(c.layer, c.k, c.num_candidates) for c in layers] == [(1, 1, TOP_K)]
        assert runner.stats().total().hits == before.hits  # a capture runs nothing, so counts nothing
        runner.replay_layer(layers[0])
        index = layers[0].index  # [2, 1, k]: expert slots, expert ids
        assert index[1].tolist() == [[2]]  # the resident expert of the top-2, not the best one (6)
        out = gathered_experts(x, routing.reweighted(index[1]), runner.cache.expert_slots, index[0], store.layout)
        runner.finish_replay()
        after = runner.stats().total()
    finally:
        runner.close()
    assert (after.hits - before.hits, after.misses - before.misses) == (1, 0)
    ran = LayerRouting(1, torch.tensor([[2]]), torch.ones(1, 1, dtype=torch.float64), probs)
    torch.testing.assert_close(out, reference(store, x, ran), rtol=0, atol=1e-12)
    assert runner.cache.resident_experts == 1 and not runner.cache._table.is_pinned((1, 2))


def test_a_replayed_verify_span_hands_every_token_its_expert_slots(store, make_routing, reference) -> None:
    """A piecewise-graphed span of several tokens (a verify pass): one wave holds the union of
    the tokens' experts, and each token's row of the index names the expert slots of its own experts."""
    from moe_serve.engine.experts.compute import gathered_experts

    tokens = 3
    runner = CachedExpertRunner(store, tokens * TOP_K * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, store.layout.hidden_size, generator=gen, dtype=torch.float64)  # [T, H]
    routing = make_routing(2, tokens, store.num_experts, TOP_K, gen)
    assert runner.can_replay(tokens) and not runner.can_replay(tokens + 1)
    try:
        with runner.capturing(lambda: None) as layers:
            runner.run(x, routing)
        assert layers[0].tokens == tokens
        with runner.recording() as used:
            runner.replay_layer(layers[0])
        index = layers[0].index  # [2, T, k]
        assert index[1].tolist() == routing.expert_ids.tolist()
        out = gathered_experts(x, routing.expert_weights, runner.cache.expert_slots, index[0], store.layout)
        runner.finish_replay()
    finally:
        runner.close()
    assert used == {2: set(routing.expert_ids.reshape(-1).tolist())}
    torch.testing.assert_close(out, reference(store, x, routing), rtol=0, atol=1e-12)


def test_recording_collects_each_layers_experts_on_the_eager_path(store, make_routing, reference) -> None:
    runner = CachedExpertRunner(store, 3 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K)
    gen = torch.Generator().manual_seed(6)
    routings = [make_routing(layer, 4, store.num_experts, TOP_K, gen) for layer in range(store.num_layers)]
    try:
        runner.run(torch.randn(4, store.layout.hidden_size, generator=gen, dtype=torch.float64), routings[0])
        with runner.recording() as used:
            for routing in routings[1:]:
                runner.run(torch.randn(4, store.layout.hidden_size, generator=gen, dtype=torch.float64), routing)
    finally:
        runner.close()
    assert used == {r.layer: set(r.expert_ids.reshape(-1).tolist()) for r in routings[1:]}


def test_each_layer_computes_in_its_own_layout(make_routing) -> None:
    """A store whose layer 1 keeps its down projection in another format (as a GGUF Q4_K_M file's
    Q6_K ffn_down): expert slots as long as the largest row, each copy moving its layer's own bytes,
    each layer decoded in its own layout, as the store's rows give."""
    h, i, e = 32, 32, 6
    q8_0, int8 = (expert_format(name, torch.float32) for name in ("q8_0", "int8"))
    layouts = [ExpertLayout(h, i, torch.float32, q8_0), ExpertLayout(h, i, torch.float32, q8_0, int8)]
    store = ExpertStore(2, e, layouts)
    gen = torch.Generator().manual_seed(5)
    for layer in range(2):
        store.put_fused(layer, gate_up=torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
                        down=torch.randn(e, h, i, generator=gen) / i**0.5)
    assert store.row_nbytes == layouts[1].nbytes > layouts[0].nbytes
    runner = CachedExpertRunner(store, 3 * store.row_nbytes, "lru", "cpu", top_k=TOP_K)
    try:
        for _ in range(3):
            for layer in range(2):
                x = torch.randn(3, h, generator=gen)
                routing = make_routing(layer, 3, e, TOP_K, gen)
                want = torch.zeros_like(x)
                accumulate_experts(want, x, routing.expert_ids, routing.expert_weights,
                                   {j: store.row(layer, j) for j in range(e)}, layouts[layer])
                torch.testing.assert_close(runner.run(x, routing), want, rtol=1e-6, atol=1e-6)
    finally:
        runner.close()
    per_layer = runner.stats().per_layer
    assert all(s.misses and s.demand_bytes == s.misses * layout.nbytes for s, layout in zip(per_layer, layouts))


def check_quantized_waves_read_expert_slots_in_place(quant: str) -> None:
    """Run with TRITON_INTERPRET=1: a quantized layer that needs more experts than the cache holds
    computes each wave with the expert kernels reading the expert slots in place, never the torch
    path's whole-expert decode, in plain waves (3 tokens) and streamed ones (8)."""
    from moe_serve.engine.experts import compute
    from moe_serve.engine.experts import runner as runner_module

    def reads_in_place(x, expert_slots, layout):  # the interpreter runs the kernels on CPU tensors
        return x.dtype == layout.dtype

    def whole_expert_decode(*args, **kwargs):
        raise AssertionError("a quantized wave took the torch path")

    h, i, e = 32, 16, 6
    layout = ExpertLayout(h, i, torch.float32, expert_format(quant, torch.float32))
    store = ExpertStore(2, e, layout)
    gen = torch.Generator().manual_seed(3)
    for layer in range(2):
        store.put_fused(layer, gate_up=torch.randn(e, 2 * i, h, generator=gen) / h**0.5,
                        down=torch.randn(e, h, i, generator=gen) / i**0.5)
    runner = CachedExpertRunner(store, 4 * store.row_nbytes, "lru", "cpu", top_k=TOP_K)
    in_place = (mock.patch.object(module, "reads_expert_slots_in_place", reads_in_place)
                for module in (compute, runner_module))
    try:
        with ExitStack() as patches:
            for patch in in_place:
                patches.enter_context(patch)
            for tokens in (3, 8, 8):
                for layer in range(2):
                    x = torch.randn(tokens, h, generator=gen)
                    probs = torch.randn(tokens, e, generator=gen).softmax(-1)  # [T, E]
                    weights, ids = probs.topk(TOP_K, dim=-1)
                    want = torch.zeros_like(x)
                    accumulate_experts(want, x, ids, weights, {j: store.row(layer, j) for j in range(e)}, layout)
                    with mock.patch.object(runner_module, "accumulate_experts", whole_expert_decode):
                        got = runner.run(x, LayerRouting(layer, ids, weights, probs))
                    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                runner.finish_step()
    finally:
        runner.close()
    assert sum(s.misses for s in runner.stats().per_layer) > 2 * e  # the layers ran in waves, refilling the cache


@needs_triton
def test_quantized_waves_run_the_expert_kernels():
    run_interpreted(__file__, "check_quantized_waves_read_expert_slots_in_place('int4')")
