"""SP-MoE cutoff: the largest prefix of layers whose prefetches fit both memory and the draft phase."""
from __future__ import annotations

import dataclasses

from moe_serve.engine.speculative.cutoff import CutoffInputs, choose_cutoff

BASE = CutoffInputs(experts_per_layer=(2,) * 8, expert_bytes=100, free_bytes=10_000,
                    t_comp=1.0, t_load=1.0, draft_depth=4, gamma=2)


def test_time_bound_limits_the_cutoff() -> None:
    # draft phase = 2 * 4 * 1s = 8s; 2 experts/layer at 1s each: 4 layers take exactly 8s
    assert choose_cutoff(BASE) == 4


def test_memory_bound_limits_the_cutoff() -> None:
    # 7 experts fit in 700 bytes: 3 layers (6 experts), the 4th would need 8
    assert choose_cutoff(dataclasses.replace(BASE, free_bytes=700)) == 3


def test_everything_fits_when_loads_are_cheap() -> None:
    assert choose_cutoff(dataclasses.replace(BASE, t_load=0.01)) == 8


def test_nothing_is_prefetched_when_one_layer_does_not_fit() -> None:
    assert choose_cutoff(dataclasses.replace(BASE, free_bytes=150)) == 0
    assert choose_cutoff(dataclasses.replace(BASE, t_comp=0.1)) == 0


def test_uneven_layers_count_their_own_experts() -> None:
    inputs = dataclasses.replace(BASE, experts_per_layer=(1, 1, 4, 1), free_bytes=10_000)
    assert choose_cutoff(inputs) == 4  # 1 + 1 + 4 + 1 = 7 loads <= 8s
    assert choose_cutoff(dataclasses.replace(inputs, gamma=1)) == 2  # 4s: the layer of 4 breaks it
