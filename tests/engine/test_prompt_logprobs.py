"""Prompt logprobs (CPU, fp32): every prompt token's logprob, rank and top alternatives equal a full
forward of the transformers model, whole or chunked, batched beside requests whose answers stay
their solo answers, sent once however often the sequence is preempted, with --spec as without."""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore, run_to_completion
from moe_serve.engine.kv.paged_cache import kv_bytes_per_token
from moe_serve.engine.loader import read_config
from moe_serve.engine.messages import GenerateRequest, RequestOutput, SamplingParams, TokenLogprob
from tests.engine.test_batching import WheneverAlone, requests, run_together, tokens
from tests.tiny_checkpoints import build_tiny_checkpoint, tiny_hf_model

FAMILY = "qwen3_moe"
PROMPT = tuple(torch.randint(3, 128, (23,), generator=torch.Generator().manual_seed(3)).tolist())
TOP = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(build_tiny_checkpoint(FAMILY, tmp_path_factory.mktemp("ckpt") / FAMILY))


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    """transformers' log-softmax at every prompt position: [P, V]."""
    with torch.no_grad():
        return torch.log_softmax(tiny_hf_model(FAMILY)(torch.tensor([PROMPT])).logits[0], dim=-1)


def scoring(request_id: str = "scored", max_tokens: int = 4, top: int = TOP) -> GenerateRequest:
    return GenerateRequest(request_id, PROMPT, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                              prompt_logprobs=top))


def prompt_logprobs(outs: list[RequestOutput]) -> list[TokenLogprob]:
    return [lp for o in outs for lp in o.prompt_logprobs]


def run_alone(core: EngineCore, request: GenerateRequest) -> list[RequestOutput]:
    assert core.add_request(request) is None
    outs: list[RequestOutput] = []
    while core.has_unfinished():
        outs += core.step()
    assert not any(o.error for o in outs)
    return outs


def assert_matches(got: list[TokenLogprob], want: torch.Tensor, top: int = TOP) -> None:
    assert [lp.token_id for lp in got] == list(PROMPT[1:])
    for i, lp in enumerate(got):  # lp scores prompt token i + 1 under position i
        row = want[i]
        assert lp.logprob == pytest.approx(row[PROMPT[i + 1]].item(), abs=1e-4)
        assert lp.rank == int((row > row[PROMPT[i + 1]] + 1e-5).sum()) + 1
        values, ids = row.topk(top)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [None, 5], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_a_full_forward_whole_or_chunked(checkpoint, reference, chunk):
    core = EngineCore(EngineConfig(model=checkpoint, max_model_len=128, max_num_batched_tokens=chunk or 512))
    try:
        outs = run_alone(core, scoring())
        assert_matches(prompt_logprobs(outs), reference)
        assert sum(bool(o.prompt_logprobs) for o in outs) == 1  # all on the first output after the prefill
        assert outs[0].prompt_logprobs and len(tokens(outs)) == 4
    finally:
        core.close()


def test_a_request_that_does_not_ask_gets_none_and_zero_alternatives_give_rank_only(checkpoint, reference):
    core = EngineCore(EngineConfig(model=checkpoint, max_model_len=128))
    try:
        plain = run_alone(core, GenerateRequest("plain", PROMPT, SamplingParams(max_tokens=4, temperature=0)))
        assert prompt_logprobs(plain) == []
        zero = prompt_logprobs(run_alone(core, scoring(top=0)))
        assert all(lp.top == () and lp.rank >= 1 for lp in zero) and len(zero) == len(PROMPT) - 1
        assert tokens(run_alone(core, scoring())) == tokens(plain)  # scoring changes no generated token
    finally:
        core.close()


def test_max_tokens_zero_scores_the_prompt_and_generates_nothing(checkpoint, reference):
    core = EngineCore(EngineConfig(model=checkpoint, max_model_len=128))
    try:
        outs = run_alone(core, scoring(max_tokens=0))
        assert tokens(outs) == [] and outs[-1].finish_reason == "length"
        assert_matches(prompt_logprobs(outs), reference)
        assert core.scheduler.blocks.num_free_blocks == core.scheduler.config.num_blocks
    finally:
        core.close()


def test_batched_beside_other_requests_in_chunks_nothing_changes(checkpoint, reference):
    """Two scoring requests among test_batching's mix, 7 tokens a step: the others' answers stay
    their solo answers and the scores stay the full forward's."""
    reqs = [*requests()[:4], scoring("s1"), scoring("s2", max_tokens=0), *requests()[4:]]
    core = EngineCore(EngineConfig(model=checkpoint, max_model_len=128, max_num_batched_tokens=7))
    try:
        together = run_together(core, reqs)
        for request in reqs:
            outs = together[request.request_id]
            assert not any(o.error for o in outs)
            if request.params.prompt_logprobs is None:
                assert tokens(outs) == run_to_completion(core, request).token_ids, request.request_id
                assert prompt_logprobs(outs) == []
            else:
                assert_matches(prompt_logprobs(outs), reference)
    finally:
        core.close()


def test_preemption_recomputes_without_sending_prompt_logprobs_twice(checkpoint, reference):
    """KV for 64 tokens (4 blocks of 16) and six 23-token prompts: sequences are preempted and
    recomputed; each scoring request still gets each prompt logprob once, equal to the full forward."""
    kv_bytes = 4 * 16 * kv_bytes_per_token(read_config(checkpoint), torch.float32)
    reqs = [scoring(f"s{i}", max_tokens=12) for i in range(3)]
    reqs += [GenerateRequest(f"p{i}", PROMPT, SamplingParams(max_tokens=12, temperature=0)) for i in range(3)]
    core = EngineCore(EngineConfig(model=checkpoint, max_model_len=64, kv_cache_memory=str(kv_bytes)))
    try:
        together = run_together(core, reqs)
        assert core.scheduler.num_preemptions > 0
        for request in reqs[:3]:
            assert_matches(prompt_logprobs(together[request.request_id]), reference)
    finally:
        core.close()


def test_a_speculating_engine_gives_the_same_prompt_logprobs(checkpoint, reference):
    core = EngineCore(EngineConfig(model=checkpoint, max_model_len=128, spec="self", spec_tokens=3,
                                   gpu_expert_budget="50%"))
    core.spec_switch = WheneverAlone()
    try:
        outs = run_alone(core, scoring(max_tokens=12))
        assert core.runtime.spec_stats.verify_steps > 0
        assert_matches(prompt_logprobs(outs), reference)
        assert sum(bool(o.prompt_logprobs) for o in outs) == 1
    finally:
        core.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_prompt_logprobs_stay_close_to_the_full_forward(checkpoint, reference):
    """On the GPU (bf16, decode batches replayed as CUDA graphs beside the scoring prefill, in chunks)."""
    core = EngineCore(EngineConfig(model=checkpoint, device="cuda", max_model_len=128, max_num_batched_tokens=7))
    try:
        together = run_together(core, [*requests()[:3], scoring("s1"), scoring("s2", max_tokens=0)])
        assert core.runtime.batch_runner.graphs is not None and core.runtime.batch_runner.graphs.capture.graphs
        for rid in ("s1", "s2"):
            got = prompt_logprobs(together[rid])
            assert [lp.token_id for lp in got] == list(PROMPT[1:]) and all(len(lp.top) == TOP for lp in got)
            want = [reference[i, t].item() for i, t in enumerate(PROMPT[1:])]
            # bf16 error grows with the logprob's size: -11.27 against fp32's -11.10 through the
            # grouped expert kernel's prefill
            assert [lp.logprob for lp in got] == pytest.approx(want, rel=0.03, abs=0.1)
    finally:
        core.close()
