"""Batched draft/verify (engine/speculative/batched.py) through the engine, on CPU in fp32: every
greedy answer of a speculating batch equals the request decoded plainly alone, for a self-draft
and a draft model, with penalties, stop tokens, logprobs and requests of different lengths in one
batch; seeded sampling repeats itself; a failing round falls back to a plain step without losing
anyone; and every KV block comes back."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore, run_to_completion
from moe_serve.engine.messages import GenerateRequest, SamplingParams
from moe_serve.engine.speculative.switch import SpecSwitch


class AsABatch(SpecSwitch):
    """Speculate on every step of two or more decoding sequences, never alone unless prefill chunks
    ride along (the measured choice is tested in test_switch.py; the lone decoder in
    test_spec_greedy.py)."""

    def speculate(self, batch: int) -> bool:
        return batch > 1

    def prefers(self, batch: int) -> bool:  # beside prefill chunks: always, even a lone sequence
        return True


def requests(params: list[SamplingParams], seed: int = 1) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(seed)
    lengths = (5, 19, 3, 11, 8)
    return [GenerateRequest(f"r{i}", tuple(torch.randint(3, 128, (lengths[i % 5],), generator=gen).tolist()), p)
            for i, p in enumerate(params)]


GREEDY = [
    SamplingParams(max_tokens=20, temperature=0),
    SamplingParams(max_tokens=14, temperature=0, logprobs=2),
    SamplingParams(max_tokens=17, temperature=0, presence_penalty=0.5, frequency_penalty=0.7),
    SamplingParams(max_tokens=9, temperature=0, logit_bias=((9, 2.0),)),
    SamplingParams(max_tokens=16, temperature=0, stop_token_ids=(9, 17)),
]


def run_batch(core: EngineCore, reqs: list[GenerateRequest]) -> dict[str, tuple[list[int], list]]:
    for request in reqs:
        assert core.add_request(request) is None
    out: dict[str, tuple[list[int], list]] = {r.request_id: ([], []) for r in reqs}
    while core.has_unfinished():
        for o in core.step():
            assert o.error is None, o.error
            out[o.request_id][0].extend(o.new_token_ids)
            out[o.request_id][1].extend(o.logprobs)
    assert core.scheduler.blocks.num_free_blocks == core.scheduler.config.num_blocks
    return out


def spec_core(target: Path, draft: Path | None, **overrides) -> EngineCore:
    config = EngineConfig(model=str(target), max_model_len=128, spec="draft" if draft else "self",
                          draft=str(draft) if draft else None, spec_tokens=3, **overrides)
    core = EngineCore(config)
    core.spec_switch = AsABatch()
    return core


def batched_rounds(core: EngineCore) -> int:
    """Counted speculative steps of batches of two or more."""
    return sum(choice.speculative.steps for bucket, choice in core.spec_switch.buckets.items() if bucket > 1)


def solo_answers(target: Path, reqs: list[GenerateRequest]) -> dict[str, tuple[list[int], list]]:
    plain = EngineCore(EngineConfig(model=str(target), max_model_len=128))
    try:
        return {r.request_id: run_batch(plain, [r])[r.request_id] for r in reqs}
    finally:
        plain.close()


def assert_same(got: dict[str, tuple[list[int], list]], want: dict[str, tuple[list[int], list]]) -> None:
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert [lp.token_id for lp in got[rid][1]] == [lp.token_id for lp in logprobs], rid
        assert [lp.logprob for lp in got[rid][1]] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-4), rid


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("drafter", ["self", "draft model"])
def test_a_speculating_batch_changes_no_greedy_answer(checkpoint: Callable[..., Path], family: str, drafter: str):
    reqs = requests(GREEDY)
    core = spec_core(checkpoint(family), checkpoint("llama", seed=3) if drafter == "draft model" else None)
    try:
        answers = run_batch(core, reqs)
        assert batched_rounds(core) > 0
    finally:
        core.close()
    assert_same(answers, solo_answers(checkpoint(family), reqs))


@pytest.mark.parametrize("drafter", ["self", "draft model"])
def test_arriving_prompts_ride_in_the_verify_pass(checkpoint: Callable[..., Path], drafter: str):
    """Requests arrive while others speculate: their prefills run in the rounds' verify forwards
    (one beside a lone decoding sequence), and no answer changes."""
    reqs = requests(GREEDY)
    core = spec_core(checkpoint("qwen3_moe"), checkpoint("llama", seed=3) if drafter == "draft model" else None)
    speculator, carried = core.runtime.speculator, []
    real = speculator.draft_and_verify

    def counting(seqs, max_model_len, chunks=None):
        carried.append((len(seqs), len(chunks or [])))
        return real(seqs, max_model_len, chunks)

    speculator.draft_and_verify = counting
    answers: dict[str, tuple[list[int], list]] = {r.request_id: ([], []) for r in reqs}
    try:
        for arrivals, steps in (([reqs[0]], 2), ([reqs[1]], 3), (reqs[2:4], 2), ([reqs[4]], 10**6)):
            for request in arrivals:
                assert core.add_request(request) is None
            for _ in range(steps):
                if not core.has_unfinished():
                    break
                for o in core.step():
                    assert o.error is None, o.error
                    answers[o.request_id][0].extend(o.new_token_ids)
                    answers[o.request_id][1].extend(o.logprobs)
        assert core.scheduler.blocks.num_free_blocks == core.scheduler.config.num_blocks
    finally:
        core.close()
    assert (1, 1) in carried and any(seqs > 1 and chunks for seqs, chunks in carried), carried
    assert_same(answers, solo_answers(checkpoint("qwen3_moe"), reqs))


def test_the_draft_model_catches_up_on_tokens_decoded_plainly(checkpoint: Callable[..., Path]):
    """Batches that speculate every other step: the draft model's cache lags behind the target's
    after each plain step and its next round feeds it what it missed, in one forward."""

    class EveryOtherStep(SpecSwitch):
        calls = 0

        def speculate(self, batch: int) -> bool:
            self.calls += 1
            return batch > 1 and self.calls % 2 == 0

    reqs = requests(GREEDY[:3])
    core = spec_core(checkpoint("qwen3_moe"), checkpoint("llama", seed=3))
    core.spec_switch = EveryOtherStep()
    try:
        answers = run_batch(core, reqs)
        assert core.runtime.spec_stats.verify_steps > 0
    finally:
        core.close()
    assert_same(answers, solo_answers(checkpoint("qwen3_moe"), reqs))


def test_seeded_sampling_in_a_speculating_batch_repeats_itself(checkpoint: Callable[..., Path]):
    params = [SamplingParams(max_tokens=15, temperature=0.9, top_p=0.9, seed=s, logprobs=1) for s in (4, 5, 6)]
    params.append(SamplingParams(max_tokens=12, temperature=1.2, top_k=30, min_p=0.02, seed=8, frequency_penalty=0.4))
    reqs = requests(params)
    runs = []
    for _ in range(2):
        core = spec_core(checkpoint("qwen3_moe"), None)
        try:
            runs.append(run_batch(core, reqs))
            assert batched_rounds(core) > 0
        finally:
            core.close()
    assert runs[0] == runs[1]
    assert all(len(tokens) == r.params.max_tokens for r, (tokens, _) in zip(reqs, runs[0].values()))


def test_a_failing_round_decodes_the_step_plainly_and_loses_no_one(checkpoint: Callable[..., Path]):
    reqs = requests(GREEDY[:4])
    core = spec_core(checkpoint("qwen3_moe"), None)
    speculator, failures = core.runtime.speculator, []
    real = speculator.draft_and_verify

    def fail_every_third(seqs, max_model_len, chunks=None):
        if len(failures) < 3 and core.runtime.spec_stats.verify_steps % 3 == 0:
            failures.append(len(seqs))
            raise RuntimeError("device fault while verifying")
        return real(seqs, max_model_len, chunks)

    speculator.draft_and_verify = fail_every_third
    try:
        answers = run_batch(core, reqs)
    finally:
        core.close()
    assert failures
    assert_same(answers, solo_answers(checkpoint("qwen3_moe"), reqs))


def test_short_kv_blocks_make_the_batch_decode_plainly(checkpoint: Callable[..., Path]):
    """Too few free blocks for every sequence's drafted positions: the step decodes plainly instead."""
    reqs = requests(GREEDY[:3])
    core = spec_core(checkpoint("qwen3_moe"), None)
    reserve = core.scheduler.reserve
    core.scheduler.reserve = lambda wanted: False
    try:
        answers = run_batch(core, reqs)
        assert core.runtime.spec_stats.verify_steps == 0
    finally:
        core.close()
    core.scheduler.reserve = reserve
    assert_same(answers, solo_answers(checkpoint("qwen3_moe"), reqs))
