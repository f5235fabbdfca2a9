"""Speculative prefetch into the real expert cache and its hand-over order; profiling; adaptive modes."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from spec_harness import CPU, RecordingSink, bind, generate, generate_with_prefetch

from moe_serve.engine.decode import PlainDecoder
from moe_serve.engine.messages import SamplingParams
from moe_serve.engine.models.blocks import CausalLM, MoEBlock
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.cross_model import CrossModelPredictor
from moe_serve.engine.speculative.draft_spec import DraftSpecDecoder
from moe_serve.engine.speculative.loop import Drafter
from moe_serve.engine.speculative.profile import (
    SpecProfile,
    plan_cutoff,
    profile_drafting,
    profile_expert_load,
)
from moe_serve.engine.speculative.self_spec import SelfSpecDecoder
from moe_serve.engine.speculative.stats import SpecStats

PROMPT = [9, 33, 2, 101, 54]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


def plain_tokens(model: CausalLM, params: SamplingParams) -> list[int]:
    bound = bind(model)
    return generate(PlainDecoder(bound), bound, PROMPT, params).output_ids


@pytest.mark.parametrize("mode", ["self", "draft"])
def test_speculative_prefetch_fills_the_cache_without_changing_tokens(target: CausalLM, draft: CausalLM,
                                                                      mode: str) -> None:
    seq, _, prefetched = generate_with_prefetch(target, draft if mode == "draft" else None, PROMPT, GREEDY)
    assert seq.output_ids == plain_tokens(target, GREEDY)
    assert prefetched > 0


def test_each_drafted_tokens_new_predictions_are_prefetched_at_once(target: CausalLM) -> None:
    """Each drafted token's predictions are prefetched right after its forward, each expert once per
    round; they are the target's own routing of the drafting layers' states (one drafting layer
    predicting several target layers here, as a shallower draft does)."""
    sink = RecordingSink()
    moe_layers = list(range(target.config.num_moe_layers))
    draft_to_target = (tuple(moe_layers[:-1]), (moe_layers[-1],))  # a two-layer draft
    predictor = CrossModelPredictor(target, draft_to_target, sink)
    gen = torch.Generator().manual_seed(0)
    # per drafted token, one state per drafting layer
    states = [[torch.randn(2, target.config.hidden_size, generator=gen) for _ in draft_to_target] for _ in range(3)]
    moe_blocks = [layer for layer in target.layers if isinstance(layer.mlp, MoEBlock)]

    def handed() -> list[tuple[int, int]]:
        return [(layer, e) for layer, experts in sink.tasks for e in experts]

    def predicted(tokens: list[list[torch.Tensor]]) -> set[tuple[int, int]]:
        """The target's own norm and router applied to the last row of each mapped state."""
        return {(m, e) for hs in tokens for d, layers in enumerate(draft_to_target) for m in layers
                for e in moe_blocks[m].mlp.routing(moe_blocks[m].mlp_norm(hs[d][-1:]), None).expert_ids[0].tolist()}

    for i, hs in enumerate(states):
        for d, h in enumerate(hs):
            predictor.on_draft_attention(d, h)
        predictor.prefetch(predictor.predictions())
        assert set(handed()) == predicted(states[: i + 1])
    assert len(handed()) == len(set(handed()))
    with predictor.verifying():
        pass
    stats = SpecStats()
    predictor.finish_round(stats)
    assert stats.needed_per_layer == [0] * len(moe_layers)  # no verify pass ran inside `verifying`


def test_a_drafted_tokens_predictions_are_handed_over_after_the_next_draft_token_launched(
        target: CausalLM, draft: CausalLM) -> None:
    """The hand-over's host work overlaps the next drafting forward; the last token's goes before verify."""
    bound = bind(target)
    decoder = DraftSpecDecoder(bound, bind(draft), SpecConfig(gamma=3), prefetch=RecordingSink())
    assert decoder.predictor is not None
    events: list[str] = []

    def logged(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            events.append(name)
            return method(*args)
        return call

    decoder.drafter.launch = logged("launch", decoder.drafter.launch)  # type: ignore[method-assign]
    decoder.predictor.prefetch = logged("hand-over", decoder.predictor.prefetch)  # type: ignore[method-assign]
    decoder._verify = logged("verify", decoder._verify)  # type: ignore[method-assign]
    generate(decoder, bound, PROMPT, SamplingParams(max_tokens=8, temperature=0.0))
    rounds: list[list[str]] = [[]]
    for event in events:
        if event == "verify":
            rounds.append([])
        else:
            rounds[-1].append(event)
    assert any(len(r) > 2 for r in rounds[:-1])
    for round_events in rounds[:-1]:
        drafted = round_events.count("launch")
        # n drafts: launch, then (launch, hand-over) n - 1 times, then the last token's hand-over
        expected = ["launch"] + ["launch", "hand-over"] * (drafted - 1) + ["hand-over"] if drafted else []
        assert round_events == expected


def test_profile_measures_and_leaves_the_drafter_as_it_was(draft: CausalLM) -> None:
    drafter = Drafter(bind(draft))
    drafter.next_logits(PROMPT)
    t_comp = profile_drafting(drafter, draft.config.num_layers, repeats=2)
    t_load = profile_expert_load(1 << 16, CPU, repeats=2)
    assert t_comp > 0 and t_load > 0
    assert drafter.kv.length == len(PROMPT)


def test_plan_cutoff_prefers_the_override_and_otherwise_bounds_by_time(target: CausalLM) -> None:
    config = dataclasses.replace(target.config, num_experts=64, top_k=2)
    slow_loads = SpecProfile(t_comp=1e-3, t_load=1.0)
    fast_loads = SpecProfile(t_comp=1.0, t_load=1e-6)
    expert_slots = config.num_moe_layers * 32  # half the experts: memory never binds (8 copies a layer)
    assert (plan_cutoff(SpecConfig(cutoff=99), config, 3, config.top_k, 1, expert_slots, slow_loads)
            == config.num_moe_layers)
    assert plan_cutoff(SpecConfig(), config, 3, config.top_k, 1, expert_slots, slow_loads) == 0
    assert plan_cutoff(SpecConfig(), config, 3, config.top_k, 1, expert_slots, fast_loads) == config.num_moe_layers


def test_plan_cutoff_keeps_the_verify_passs_peak_free_and_counts_only_uncached_experts(target: CausalLM) -> None:
    """4 MoE layers of 8 experts, gamma = 2, k = 2: one verify layer pins min(6, 8) expert slots;
    each layer's drafts predict min(4, 8) experts, of which the uncached share (1 - expert slots / 32)
    is copied."""
    config = dataclasses.replace(target.config, num_experts=8, top_k=2, moe_layers=(0, 1, 2, 3))
    fast_loads = SpecProfile(t_comp=1.0, t_load=1e-6)
    spec = SpecConfig(gamma=2)
    # 8 expert slots: 2 free, each layer copies 4 * (1 - 8/32) = 3 of its predictions: not one layer
    assert plan_cutoff(spec, config, 3, 2, 1, 6 + 2, fast_loads) == 0
    # 16 expert slots: 10 free, 4 * (1 - 16/32) = 2 per layer: every layer
    assert plan_cutoff(spec, config, 3, 2, 1, 6 + 10, fast_loads) == 4
    # 12 expert slots: 6 free, 4 * (1 - 12/32) = 2.5 per layer: two layers (5), not three (7.5)
    assert plan_cutoff(spec, config, 3, 2, 1, 6 + 6, fast_loads) == 2
    # a self-draft with k - r = 1: 2 * (1 - 12/32) = 1.25 per layer: four layers (5)
    assert plan_cutoff(spec, config, 3, 1, 1, 6 + 6, fast_loads) == 4


def test_adaptive_gamma_keeps_greedy_exact(target: CausalLM) -> None:
    bound = bind(target)
    decoder = SelfSpecDecoder(bound, SpecConfig(gamma=5, adaptive_gamma=True))
    assert generate(decoder, bound, PROMPT, GREEDY).output_ids == plain_tokens(target, GREEDY)
    assert decoder.adaptive is not None and decoder.adaptive.seconds_per_verify is not None


def test_lossy_adaptive_acceptance_is_wired_through(target: CausalLM) -> None:
    """Tolerance T = 1 keeps every draft the target gives any mass (all, without top-k/top-p)."""
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7)
    bound = bind(target)
    decoder = SelfSpecDecoder(bound, SpecConfig(gamma=4, adaptive_tolerance=1.0))
    seq = generate(decoder, bound, PROMPT, params)
    assert len(seq.output_ids) == params.max_tokens
    assert decoder.stats.draft_tokens > 0 and decoder.stats.acceptance_rate == 1.0


def test_spec_config_rejects_nonsense() -> None:
    for bad in ({"gamma": 0}, {"top_r": 0}, {"confidence": 1.5}, {"cutoff": -1}, {"adaptive_tolerance": 2.0}):
        with pytest.raises(ValueError):
            SpecConfig(**bad)
    assert dataclasses.replace(SpecConfig(), gamma=2).gamma == 2


def test_drafter_leaves_unset_options_out(draft: CausalLM) -> None:
    """Plain one-token draft calls keep BoundModel's CUDA-graph path open."""
    assert Drafter(bind(draft), moe_top_r=None, on_attention_output=None).forward_kwargs == {}
    assert Drafter(bind(draft), moe_top_r=1, on_attention_output=None).forward_kwargs == {"moe_top_r": 1}
