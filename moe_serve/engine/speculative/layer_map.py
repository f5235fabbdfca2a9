"""Which draft layer's attention output predicts which target MoE layer (SP-MoE cross-model prediction).

Layers correspond by relative depth: target decoder layer t is predicted from draft layer
floor(t * D / T) for draft depth D and target depth T. Equal depths map one to one; a shallower
draft predicts several target layers from one of its layers; a deeper draft leaves some of its
layers idle. Taking the floor picks the earliest draft layer of the proportional span, which gives
the copy the most time to land.
"""
from __future__ import annotations

from collections.abc import Sequence


def draft_layer_for(target_layer: int, target_depth: int, draft_depth: int) -> int:
    if not 0 <= target_layer < target_depth:
        raise ValueError(f"target layer {target_layer} outside a {target_depth}-layer target")
    if draft_depth <= 0:
        raise ValueError(f"draft depth must be positive, got {draft_depth}")
    return target_layer * draft_depth // target_depth


def layer_map(draft_depth: int, target_depth: int, target_moe_layers: Sequence[int],
              cutoff: int | None = None) -> tuple[tuple[int, ...], ...]:
    """[draft layer] -> indices into target_moe_layers predicted there, for the first `cutoff` MoE layers.

    target_moe_layers lists the decoder-layer index of each target MoE layer (dense layers of
    families like DeepSeek are skipped by the router and so by the predictor).
    """
    mapped: list[list[int]] = [[] for _ in range(draft_depth)]
    for moe_index, target_layer in enumerate(target_moe_layers[:cutoff]):
        mapped[draft_layer_for(target_layer, target_depth, draft_depth)].append(moe_index)
    return tuple(tuple(m) for m in mapped)
