"""Victim order of LRU, LFU, MRS and next-use on hand-made access sequences."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_serve.engine.experts.policies import LFUPolicy, LRUPolicy, MRSPolicy, NextUsePolicy, make_policy

A, B, C, D = (0, 0), (0, 1), (0, 2), (0, 3)


def test_lru_evicts_least_recently_used_first() -> None:
    policy = LRUPolicy()
    for key in (A, B, C):
        policy.admit(key)
    policy.touch(A)  # order of last use: B, C, A
    assert policy.victims([A, B, C], 3) == [B, C, A]
    assert policy.victims([A, C], 1) == [C]  # only among the candidates


def test_lfu_evicts_least_used_and_breaks_ties_by_recency() -> None:
    policy = LFUPolicy()
    for key in (A, B, C, D):
        policy.admit(key)
    for key in (A, A, A, B, B, C, D):
        policy.touch(key)  # uses: A3 B2 C1 D1; C used before D
    assert policy.victims([A, B, C, D], 4) == [C, D, B, A]


def test_lfu_counts_survive_eviction() -> None:
    policy = LFUPolicy()
    for key in (A, A, B):
        policy.touch(key)
    policy.admit(A)  # A was evicted and comes back: its history stays
    assert policy.victims([A, B], 1) == [B]


def test_mrs_formula_numerically() -> None:
    policy = MRSPolicy(top_p=2, alpha=0.5)
    policy.observe_scores(0, [0.5, 0.3, 0.2, 0.0])
    # top-2 are experts 0 and 1: S = 0.5 * s for them, 0 elsewhere
    assert [policy.score((0, e)) for e in range(4)] == pytest.approx([0.25, 0.15, 0.0, 0.0])
    policy.observe_scores(0, [0.1, 0.2, 0.6, 0.1])
    # top-2 are 2 and 1; everything decays by (1 - alpha)
    assert [policy.score((0, e)) for e in range(4)] == pytest.approx([0.125, 0.175, 0.3, 0.0])
    assert policy.victims([A, B, C, D], 4) == [D, A, B, C]


def test_mrs_layers_are_independent_and_ties_fall_back_to_lru() -> None:
    policy = MRSPolicy(top_p=1, alpha=1.0)
    policy.observe_scores(1, [0.9, 0.1])
    for key in ((1, 1), (0, 0), (0, 1)):
        policy.admit(key)
    # layer 0 never scored and (1, 1) is outside layer 1's top-1: all score 0, oldest first
    assert policy.victims([(0, 1), (0, 0), (1, 1), (1, 0)], 4) == [(1, 1), (0, 0), (0, 1), (1, 0)]


def _run(policy: NextUsePolicy, layer: int, *experts: int) -> None:
    """One run of `layer` that routes to `experts` (copied in first when not resident)."""
    policy.begin_run(layer)
    for e in experts:
        if (layer, e) not in policy._recency:
            policy.admit((layer, e))
        policy.touch((layer, e))


def test_next_use_keeps_the_layers_that_run_next() -> None:
    """Three layers, each run routed to experts 0 and 1: while layer 0 runs again, layer 1 is
    needed next and layer 2 (which just ran) last; equal rates, so the layer order decides."""
    policy = NextUsePolicy(num_layers=3, prior=0.5, alpha=0.5)
    for layer in range(3):
        _run(policy, layer, 0, 1)
    _run(policy, 0, 0, 1)
    assert [policy.rate((layer, 0)) for layer in range(3)] == [0.875, 0.75, 0.75]
    # u + L (1 - p) / p with L = 3: layer 1 is 1 run away, layer 2 two
    assert policy.runs_until_needed((1, 0)) == pytest.approx(1 + 3 * 0.25 / 0.75)
    assert policy.runs_until_needed((2, 0)) == pytest.approx(2 + 3 * 0.25 / 0.75)
    assert policy.victims([(1, 0), (2, 1), (1, 1), (2, 0)], 4) == [(2, 0), (2, 1), (1, 0), (1, 1)]


def test_next_use_evicts_an_expert_its_layer_stopped_routing_to() -> None:
    policy = NextUsePolicy(num_layers=2, prior=0.5, alpha=0.5)
    _run(policy, 1, 5)  # (1, 5) routed once, then never again
    for _ in range(3):
        _run(policy, 0, 0)
        _run(policy, 1, 0)
    _run(policy, 0, 0)
    assert policy.rate((1, 5)) == pytest.approx(0.75 * 0.5 ** 3)  # three runs of layer 1 without it
    policy.admit((0, 1))  # never routed to since: the prior, one run old
    assert policy.victims([(1, 0), (0, 1), (1, 5)], 1) == [(1, 5)]


def test_next_use_counts_the_waves_of_one_run_once() -> None:
    policy = NextUsePolicy(num_layers=2, prior=0.5, alpha=0.5)
    _run(policy, 0, 0)
    policy.admit((0, 1))  # a second wave of the same run (no begin_run): (0, 1) copied in, both used
    policy.touch((0, 0))
    policy.touch((0, 1))
    assert policy.rate((0, 0)) == policy.rate((0, 1)) == 0.75
    _run(policy, 0, 0)  # a model whose one MoE layer runs again: a new run
    assert policy.rate((0, 0)) == 0.875 and policy.rate((0, 1)) == 0.375


def test_make_policy_by_name_and_unknown_name_lists_choices() -> None:
    assert isinstance(make_policy("lru", 2, 4, 8), LRUPolicy)
    assert isinstance(make_policy("lfu", 2, 4, 8), LFUPolicy)
    mrs = make_policy("mrs", 2, 4, 8)
    assert isinstance(mrs, MRSPolicy) and mrs.top_p == 4
    next_use = make_policy("next-use", 2, 4, 8)
    assert isinstance(next_use, NextUsePolicy) and (next_use.num_layers, next_use.prior) == (4, 0.25)
    with pytest.raises(ValueError, match="lru, lfu, mrs, next-use"):
        make_policy("fifo", 2, 4, 8)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["run", "admit", "touch", "evict", "victims"]),
                          st.integers(0, 2), st.integers(0, 5), st.integers(1, 4)), max_size=80))
def test_next_use_victims_are_the_largest_estimates(ops: list[tuple[str, int, int, int]]) -> None:
    """The per-layer heaps pick what ranking every candidate by (estimate, stamp) would."""
    policy = NextUsePolicy(num_layers=3, prior=0.25, alpha=0.3)
    resident: set[tuple[int, int]] = set()
    for op, layer, expert, n in ops:
        key = (layer, expert)
        if op == "run":
            policy.begin_run(layer)
        elif op == "admit" and key not in resident:
            policy.admit(key)
            resident.add(key)
        elif op == "touch" and key in resident:
            policy.touch(key)
        elif op == "evict" and key in resident:
            policy.evicted(key)
            resident.discard(key)
        elif op == "victims":
            candidates = {k for k in resident if k[1] != expert}  # some residents are pinned
            chosen = policy.victims(candidates, n)
            ranked = sorted(candidates, key=lambda k: (-policy.runs_until_needed(k), policy._stamp[k]))
            assert [policy.runs_until_needed(k) for k in chosen] == pytest.approx(
                [policy.runs_until_needed(k) for k in ranked[:n]])
            assert len(set(chosen)) == len(chosen) and set(chosen) <= candidates
