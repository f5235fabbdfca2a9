"""Victim order of LRU, LFU and MRS on hand-made access sequences."""
from __future__ import annotations

import pytest

from engine.experts.policies import LFUPolicy, LRUPolicy, MRSPolicy, make_policy

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


def test_make_policy_by_name_and_unknown_name_lists_choices() -> None:
    assert isinstance(make_policy("lru", 2), LRUPolicy)
    assert isinstance(make_policy("lfu", 2), LFUPolicy)
    mrs = make_policy("mrs", 2)
    assert isinstance(mrs, MRSPolicy) and mrs.top_p == 4
    with pytest.raises(ValueError, match="lru, lfu, mrs"):
        make_policy("fifo", 2)
