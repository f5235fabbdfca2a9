"""Start-up profile for the cutoff layer: seconds per drafting layer and per expert copy.

Medians over a few repeats after one warm-up; on CUDA the device is synchronised around each
timed call so the clock sees the work, not the launch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.cutoff import CutoffInputs, choose_cutoff
from moe_serve.engine.speculative.loop import Drafter
from moe_serve.engine.timing import median_seconds


@dataclass(frozen=True)
class SpecProfile:
    t_comp: float  # seconds per drafting layer for one drafted token
    t_load: float  # seconds to copy one expert host -> device


def profile_drafting(drafter: Drafter, depth: int, repeats: int = 5) -> float:
    """t_comp: one single-token drafting forward, per layer. Leaves the drafter's cache as it was."""
    length = drafter.kv.length

    def one_token() -> None:
        drafter.next_logits([0] * (length + 1))
        drafter.kv.truncate(length)

    return median_seconds(one_token, drafter.model.device, repeats) / depth


def profile_expert_load(expert_bytes: int, device: torch.device, repeats: int = 5) -> float:
    """t_load: one expert-sized copy from pinned host memory, as the expert cache copies."""
    pin = device.type == "cuda"
    src = torch.empty(expert_bytes, dtype=torch.uint8, pin_memory=pin)  # [bytes]
    dst = torch.empty(expert_bytes, dtype=torch.uint8, device=device)  # [bytes]
    return median_seconds(lambda: dst.copy_(src, non_blocking=pin), device, repeats)


def plan_cutoff(config: SpecConfig, target: ModelConfig, draft_depth: int, experts_per_token: int,
                expert_bytes: int, expert_slot_count: int, profile: SpecProfile) -> int:
    """--spec-cutoff when given, else SP-MoE's bound for our expert cache.

    Per MoE layer a draft phase predicts `experts_per_token` experts for each of gamma drafted
    tokens (k for a separate draft; k - r for self-drafting, whose r drafted experts are
    resident): at most min(gamma * that, E) distinct ones. Only the ones not cached are copied
    (Algorithm 1 drops the rest), and an expert is cached with about the cache's share of all
    experts, so n_l = min(gamma * that, E) * (1 - expert slots / all experts). SP-MoE's memory
    constraint (peak + prefetched <= GPU memory) becomes: prefetched <= the cache's expert slots
    minus the verify pass's peak, the one layer it pins at a time, min((gamma + 1) * k, E) experts.
    Prefetching more than that evicts experts the verify pass needs before it gets to them."""
    if config.cutoff is not None:
        return min(config.cutoff, target.num_moe_layers)
    predicted = min(config.gamma * experts_per_token, target.num_experts)
    uncached = 1.0 - min(1.0, expert_slot_count / (target.num_moe_layers * target.num_experts))
    peak = min((config.gamma + 1) * target.top_k, target.num_experts)
    return choose_cutoff(CutoffInputs(
        experts_per_layer=(predicted * uncached,) * target.num_moe_layers, expert_bytes=expert_bytes,
        free_bytes=max(0, expert_slot_count - peak) * expert_bytes, t_comp=profile.t_comp, t_load=profile.t_load,
        draft_depth=draft_depth, gamma=config.gamma))
