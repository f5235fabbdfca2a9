"""Missed experts on the CPU: the HybriMoE decision from a cost model, and unchanged math."""
from __future__ import annotations

import math

import pytest
import torch
from runner_harness import drive

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.experts.cpu_experts import ExpertCosts, choose_cpu_experts, profile_costs
from moe_serve.engine.experts.runner import CachedExpertRunner

TOP_K = 2
ALL_ON_CPU = ExpertCosts(copy_seconds=1.0, cpu_base_seconds=0.0, cpu_per_token_seconds=0.0)
SOME_ON_CPU = ExpertCosts(copy_seconds=1.0, cpu_base_seconds=0.6, cpu_per_token_seconds=0.0)


def test_cpu_takes_the_least_loaded_misses_while_that_shortens_the_layer() -> None:
    costs = ExpertCosts(copy_seconds=1.0, cpu_base_seconds=0.2, cpu_per_token_seconds=0.2)
    # copies alone: 3.0; expert 2 (1 token) on the CPU: max(0.4, 2.0); then 7: max(1.0, 1.0);
    # then 5 would make it max(1.8, 0.0) = 1.8 > 1.0
    assert choose_cpu_experts({5: 3, 2: 1, 7: 2}, costs) == [2, 7]
    assert choose_cpu_experts({4: 1}, ExpertCosts(1.0, 1.5, 0.0)) == []  # one copy beats one slow CPU run
    assert choose_cpu_experts({4: 1, 6: 1, 9: 1}, ExpertCosts(1.0, 1.5, 0.0)) == [4]  # but it overlaps 2 copies
    assert choose_cpu_experts({}, costs) == []
    assert choose_cpu_experts({1: 4, 3: 2}, ALL_ON_CPU) == [3, 1]


@pytest.mark.parametrize("policy,prefetch", [("lru", "none"), ("mrs", "next-layer")])
@pytest.mark.parametrize("expert_slots,tokens", [(10, 1), (10, 3), (3, 4)], ids=["decode", "verify", "waves"])
def test_output_equals_reference_with_some_misses_on_the_cpu(store, make_routing, reference, policy, prefetch,
                                                             expert_slots, tokens) -> None:
    runner = CachedExpertRunner(store, expert_slots * store.layout.nbytes, policy, "cpu", top_k=TOP_K,
                                prefetch=prefetch, cpu_experts="auto", cpu_costs=SOME_ON_CPU)
    runner.set_router_weights([torch.randn(store.num_experts, store.layout.hidden_size, dtype=torch.float64)
                               for _ in range(store.num_layers)])
    try:
        drive(runner, store, make_routing, reference, steps=3, tokens=tokens, top_k=TOP_K)
    finally:
        runner.close()
    total = runner.stats().total()
    copied = total.demand_bytes // store.layout.nbytes
    assert total.cpu_expert_computations > 0 and copied > 0
    assert total.misses == copied + total.cpu_expert_computations


def test_all_misses_on_the_cpu_copy_nothing(store, make_routing, reference) -> None:
    runner = CachedExpertRunner(store, 4 * store.layout.nbytes, "lru", "cpu", top_k=TOP_K, cpu_experts="auto",
                                cpu_costs=ALL_ON_CPU)
    try:
        drive(runner, store, make_routing, reference, steps=3, tokens=1, top_k=TOP_K)
    finally:
        runner.close()
    total = runner.stats().total()
    assert total.cpu_expert_computations == total.misses > 0
    assert (total.hits, total.demand_bytes, runner.resident_experts) == (0, 0, 0)


def test_profiled_costs_are_measured_and_drive_auto(store, make_routing, reference) -> None:
    costs = profile_costs(store, torch.device("cpu"), repeats=2)
    assert costs.copy_seconds > 0 and costs.cpu_seconds(1) > 0 and costs.cpu_per_token_seconds >= 0
    assert all(math.isfinite(v) for v in (costs.copy_seconds, costs.cpu_base_seconds, costs.cpu_per_token_seconds))
    runner = CachedExpertRunner.from_config(store, EngineConfig(model="m", gpu_expert_budget="25%", cpu_experts="auto"),
                                            top_k=TOP_K)
    try:
        assert runner.cpu_costs is not None
        drive(runner, store, make_routing, reference, steps=1, tokens=2, top_k=TOP_K)
    finally:
        runner.close()


def test_cpu_experts_off_or_all_resident_profiles_nothing(store) -> None:
    assert CachedExpertRunner(store, 0.5, "lru", "cpu", top_k=TOP_K).cpu_costs is None
    resident = CachedExpertRunner(store, None, "lru", "cpu", top_k=TOP_K, cpu_experts="auto")
    assert resident.cpu_costs is None  # every expert resident: nothing is ever missed
    with pytest.raises(ValueError, match="off, auto"):
        CachedExpertRunner(store, 0.5, "lru", "cpu", top_k=TOP_K, cpu_experts="always")
