"""Proportional draft -> target layer correspondence for cross-model expert prediction."""
from __future__ import annotations

import pytest

from moe_serve.engine.speculative.layer_map import draft_layer_for, layer_map


def test_equal_depths_map_one_to_one() -> None:
    assert layer_map(4, 4, (0, 1, 2, 3)) == ((0,), (1,), (2,), (3,))


def test_shallower_draft_predicts_several_target_layers_per_layer() -> None:
    assert layer_map(2, 4, (0, 1, 2, 3)) == ((0, 1), (2, 3))


def test_deeper_draft_leaves_layers_idle_and_predicts_early() -> None:
    assert layer_map(6, 3, (0, 1, 2)) == ((0,), (), (1,), (), (2,), ())


def test_dense_target_layers_are_skipped_and_cutoff_truncates() -> None:
    # target layer 0 is dense: MoE index 0 is decoder layer 1, index 2 is layer 3
    assert layer_map(4, 4, (1, 2, 3)) == ((), (0,), (1,), (2,))
    assert layer_map(4, 4, (1, 2, 3), cutoff=2) == ((), (0,), (1,), ())
    assert layer_map(4, 4, (1, 2, 3), cutoff=0) == ((), (), (), ())


def test_every_target_layer_maps_inside_the_draft() -> None:
    for draft_depth in range(1, 9):
        for target_depth in range(1, 9):
            mapped = [draft_layer_for(t, target_depth, draft_depth) for t in range(target_depth)]
            assert all(0 <= d < draft_depth for d in mapped)
            assert mapped == sorted(mapped)


def test_out_of_range_layers_are_rejected() -> None:
    with pytest.raises(ValueError):
        draft_layer_for(4, 4, 2)
    with pytest.raises(ValueError):
        draft_layer_for(0, 4, 0)
