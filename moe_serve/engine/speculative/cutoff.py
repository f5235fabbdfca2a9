"""SP-MoE's cutoff layer: how many leading target MoE layers get their experts prefetched while drafting.

Prefetching layer l's predicted experts pays off only if they arrive before the verify pass
needs them and do not push out experts it needs more. With n_l experts to copy for layer l
during one draft phase, the cutoff is the largest L (a count: layers 0..L-1 are prefetched) with

    memory:  sum_{l<L} n_l * expert_bytes <= free_bytes
    time:    sum_{l<L} n_l * t_load      <= gamma * draft_depth * t_comp

free_bytes is what the expert cache can hold beyond what must stay resident (the verify pass's
peak, subtracted by profile.plan_cutoff); gamma * draft_depth * t_comp is the length of the draft
phase, so the copies are hidden behind drafting instead of stalling the verify pass.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CutoffInputs:
    experts_per_layer: Sequence[float]  # n_l, experts copied for each target MoE layer (expected), in layer order
    expert_bytes: int
    free_bytes: int
    t_comp: float  # seconds per draft layer per drafted token
    t_load: float  # seconds to copy one expert host -> device
    draft_depth: int  # layers the draft runs per drafted token
    gamma: int  # drafted tokens per draft phase


def choose_cutoff(inputs: CutoffInputs) -> int:
    """Number of leading target MoE layers to prefetch for (0 = none)."""
    draft_phase_seconds = inputs.gamma * inputs.draft_depth * inputs.t_comp
    experts = 0.0
    for cutoff, n in enumerate(inputs.experts_per_layer):
        experts += n
        fits_memory = experts * inputs.expert_bytes <= inputs.free_bytes
        fits_time = experts * inputs.t_load <= draft_phase_seconds
        if not (fits_memory and fits_time):
            return cutoff
    return len(inputs.experts_per_layer)
