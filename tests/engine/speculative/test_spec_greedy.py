"""Speculative greedy decoding emits exactly plain greedy's tokens, for every MoE family.

Targets run on the cached expert runner with a budget of top_k + 1 experts (far below all of
them), so verify passes run in waves and drafts evict each other's experts.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
from spec_harness import RecordingSink, assert_kv_matches_prefill, bind, generate

from moe_serve.engine.decode import BoundModel, PlainDecoder
from moe_serve.engine.messages import SamplingParams
from moe_serve.engine.models.blocks import CausalLM
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.draft_spec import DraftSpecDecoder
from moe_serve.engine.speculative.loop import SpecDecoder
from moe_serve.engine.speculative.self_spec import SelfSpecDecoder

PROMPT = [5, 17, 99, 3, 42, 64, 7]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def plain_tokens(model: CausalLM, params: SamplingParams, max_model_len: int = 64) -> list[int]:
    bound = bind(model)
    return generate(PlainDecoder(bound), bound, PROMPT, params, max_model_len).output_ids


def self_spec(model: CausalLM, gamma: int) -> tuple[SpecDecoder, BoundModel]:
    bound = bind(model)
    return SelfSpecDecoder(bound, SpecConfig(gamma=gamma, top_r=1), prefetch=RecordingSink()), bound


def draft_spec(model: CausalLM, draft_model: CausalLM, gamma: int) -> tuple[SpecDecoder, BoundModel]:
    bound = bind(model)
    return DraftSpecDecoder(bound, bind(draft_model), SpecConfig(gamma=gamma), prefetch=RecordingSink()), bound


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_self_spec_greedy_equals_plain(target: CausalLM, gamma: int) -> None:
    decoder, bound = self_spec(target, gamma)
    seq = generate(decoder, bound, PROMPT, GREEDY)
    assert seq.output_ids == plain_tokens(target, GREEDY)
    assert decoder.stats.accepted_tokens > 0, "top-1 drafts of a top-k model should often be kept"
    assert_kv_matches_prefill(bound, seq.all_ids[:-1])


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_draft_spec_greedy_equals_plain(target: CausalLM, draft: CausalLM, gamma: int) -> None:
    decoder, bound = draft_spec(target, draft, gamma)
    seq = generate(decoder, bound, PROMPT, GREEDY)
    assert seq.output_ids == plain_tokens(target, GREEDY)
    assert decoder.stats.draft_tokens > 0
    assert_kv_matches_prefill(bound, seq.all_ids[:-1])


def test_a_perfect_draft_is_always_kept_and_its_cache_rolls_back(target: CausalLM) -> None:
    """The target drafting for itself (own cache): every draft kept, bonus token every round."""
    decoder, bound = draft_spec(target, target, gamma=3)
    seq = generate(decoder, bound, PROMPT, GREEDY)
    assert seq.output_ids == plain_tokens(target, GREEDY)
    assert decoder.stats.acceptance_rate == 1.0
    assert decoder.stats.accepted_at_position[0] == decoder.stats.drafts
    assert decoder.drafter.kv.length <= len(seq.all_ids) - 1
    assert_kv_matches_prefill(decoder.drafter.model, seq.all_ids[: decoder.drafter.kv.length])


@pytest.mark.parametrize("mode", ["self", "draft"])
@pytest.mark.parametrize("max_tokens", [1, 2, 4, 6])
def test_max_tokens_is_never_exceeded(target: CausalLM, draft: CausalLM, mode: str, max_tokens: int) -> None:
    params = dataclasses.replace(GREEDY, max_tokens=max_tokens)
    decoder, bound = self_spec(target, 5) if mode == "self" else draft_spec(target, target, 5)
    seq = generate(decoder, bound, PROMPT, params)
    assert seq.output_ids == plain_tokens(target, params)
    assert len(seq.output_ids) == max_tokens and seq.finish_reason == "length"


@pytest.mark.parametrize("mode", ["self", "draft"])
def test_stops_at_the_first_stop_token(target: CausalLM, mode: str) -> None:
    reference = plain_tokens(target, GREEDY)
    stop = reference[4]  # stop at its first occurrence, which may be before index 4
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    decoder, bound = self_spec(target, 5) if mode == "self" else draft_spec(target, target, 5)
    seq = generate(decoder, bound, PROMPT, params)
    assert seq.output_ids == reference[: reference.index(stop) + 1]
    assert seq.finish_reason == "stop"
    assert_kv_matches_prefill(bound, seq.all_ids[:-1])


@pytest.mark.parametrize("mode", ["self", "draft"])
def test_context_end_is_respected(target: CausalLM, mode: str) -> None:
    max_model_len = len(PROMPT) + 4
    decoder, bound = self_spec(target, 5) if mode == "self" else draft_spec(target, target, 5)
    seq = generate(decoder, bound, PROMPT, GREEDY, max_model_len)
    assert seq.output_ids == plain_tokens(target, GREEDY, max_model_len)
    assert len(seq.all_ids) == max_model_len and seq.finish_reason == "length"


def test_penalties_follow_the_running_counts(target: CausalLM) -> None:
    params = dataclasses.replace(GREEDY, presence_penalty=1.5, frequency_penalty=0.7)
    for decoder, bound in (self_spec(target, 4), draft_spec(target, target, 4)):
        assert generate(decoder, bound, PROMPT, params).output_ids == plain_tokens(target, params)


def test_self_spec_hands_each_drafted_tokens_top_k_to_prefetch(target: CausalLM) -> None:
    """The whole top-k goes to the cache, which drops what is resident: the draft may have run a
    resident expert instead of one of its top-r, and then the verify pass needs that one too. An
    expert already handed over in the same round is not handed over again."""
    sink = RecordingSink()
    bound = bind(target)
    decoder = SelfSpecDecoder(bound, SpecConfig(gamma=3, top_r=1), prefetch=sink)
    generate(decoder, bound, PROMPT, GREEDY)
    k, moe_layers = target.config.top_k, target.config.num_moe_layers
    assert sink.tasks and all(0 < len(set(experts)) == len(experts) <= k for _, experts in sink.tasks)
    assert {layer for layer, _ in sink.tasks} == set(range(moe_layers))
    accuracy = decoder.stats.predictor_accuracy_per_layer
    assert len(accuracy) == moe_layers and all(0.0 < a <= 1.0 for a in accuracy)


def test_cutoff_limits_the_prefetched_layers(target: CausalLM, draft: CausalLM) -> None:
    sink = RecordingSink()
    decoder = DraftSpecDecoder(bind(target), bind(draft), SpecConfig(gamma=3), prefetch=sink, cutoff=1)
    generate(decoder, decoder.target, PROMPT, GREEDY)
    assert sink.tasks and {layer for layer, _ in sink.tasks} == {0}
    assert all(0 < len(experts) <= target.config.top_k for _, experts in sink.tasks)


@pytest.mark.parametrize("mode", ["self", "draft"])
def test_cutoff_zero_is_plain_speculation(target: CausalLM, draft: CausalLM, mode: str) -> None:
    """No layer to predict: no hook in the drafts, no prefetch task, no accuracy counters."""
    sink = RecordingSink()
    bound = bind(target)
    decoder = (SelfSpecDecoder(bound, SpecConfig(gamma=3, top_r=1), prefetch=sink, cutoff=0) if mode == "self"
               else DraftSpecDecoder(bound, bind(draft), SpecConfig(gamma=3), prefetch=sink, cutoff=0))
    assert decoder.predictor is None and "on_attention_output" not in decoder.drafter.forward_kwargs
    assert generate(decoder, bound, PROMPT, GREEDY).output_ids == plain_tokens(target, GREEDY)
    assert sink.tasks == []


def test_hidden_size_mismatch_turns_cross_prediction_off(target: CausalLM, draft: CausalLM,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    narrow = CausalLM(dataclasses.replace(draft.config, hidden_size=32), None)
    with caplog.at_level(logging.WARNING):
        decoder = DraftSpecDecoder(bind(target), bind(narrow), SpecConfig(gamma=2), prefetch=RecordingSink())
    assert decoder.predictor is None
    assert "cross-model expert prediction off" in caplog.text
    seq = generate(decoder, decoder.target, PROMPT, GREEDY)
    assert seq.output_ids == plain_tokens(target, GREEDY)


def test_vocabulary_mismatch_is_refused(target: CausalLM, draft: CausalLM) -> None:
    other = CausalLM(dataclasses.replace(draft.config, vocab_size=100), None)
    with pytest.raises(ValueError, match="tokenizer"):
        DraftSpecDecoder(bind(target), bind(other), SpecConfig())


def test_self_draft_must_use_fewer_experts_than_the_target(target: CausalLM) -> None:
    with pytest.raises(ValueError, match="top_k"):
        SelfSpecDecoder(bind(target), SpecConfig(top_r=target.config.top_k))


def test_confidence_threshold_stops_drafting_early(target: CausalLM) -> None:
    bound = bind(target)
    sure = SelfSpecDecoder(bound, SpecConfig(gamma=5, top_r=1, confidence=1.0))
    seq = generate(sure, bound, PROMPT, GREEDY)
    assert seq.output_ids == plain_tokens(target, GREEDY)
    assert sure.stats.draft_tokens == sure.stats.drafts, "tau = 1: every round stops after one draft"
