"""Continuous batching changes nothing a request gets: every answer produced in a batch equals the
same request decoded alone (CPU, fp32), for every family, with greedy, seeded sampling, penalties
and logprobs mixed in one batch, through chunked prefills, preemptions, an offloaded expert cache
and aborts; a request whose step fails alone gets the error and the rest of its batch goes on."""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore, run_to_completion
from moe_serve.engine.kv.paged_cache import kv_bytes_per_token
from moe_serve.engine.loader import read_config
from moe_serve.engine.speculative.switch import SpecSwitch
from moe_serve.engine.messages import GenerateRequest, RequestOutput, SamplingParams
from tests.tiny_checkpoints import DENSE_FAMILIES, MOE_FAMILIES, build_tiny_checkpoint


def requests(lengths: tuple[int, ...] = (3, 17, 1, 30, 8, 12)) -> list[GenerateRequest]:
    gen = torch.Generator().manual_seed(7)
    params = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=9, temperature=0.8, seed=11, logprobs=3),
        SamplingParams(max_tokens=15, temperature=1.0, top_k=20, top_p=0.9, seed=5, min_p=0.05,
                       repetition_penalty=1.3),
        SamplingParams(max_tokens=7, temperature=0, presence_penalty=0.5, frequency_penalty=0.7, logprobs=0),
        SamplingParams(max_tokens=11, temperature=0.6, seed=3, frequency_penalty=1.0),
        SamplingParams(max_tokens=14, temperature=0, stop_token_ids=(9,), min_tokens=4, logit_bias=((9, 3.0),)),
    ]
    return [GenerateRequest(f"r{i}", tuple(torch.randint(3, 128, (n,), generator=gen).tolist()), p)
            for i, (n, p) in enumerate(zip(lengths, params))]


def run_together(core: EngineCore, reqs: list[GenerateRequest], abort: str | None = None) -> dict[str, list[RequestOutput]]:
    """All requests at once (two of them arrive a few steps late); abort one after its third step."""
    outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in reqs}
    late, steps = reqs[-2:], 0
    for request in reqs[:-2]:
        assert core.add_request(request) is None
    while core.has_unfinished() or late:
        if steps == 3:
            for request in late:
                assert core.add_request(request) is None
            late = []
        if abort is not None and steps == 3:
            final = core.abort_request(abort)
            assert final is not None and final.finish_reason == "abort"
            outputs[abort].append(final)
        for out in core.step():
            outputs[out.request_id].append(out)
        steps += 1
    return outputs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def check_equal_to_solo(config: EngineConfig, abort: str | None = None,
                        reqs: list[GenerateRequest] | None = None) -> EngineCore:
    reqs = requests() if reqs is None else reqs
    core = EngineCore(config)
    try:
        together = run_together(core, reqs, abort)
        for request in reqs:
            outs = together[request.request_id]
            assert outs[-1].finish_reason is not None and not any(o.error for o in outs)
            if request.request_id == abort:
                continue
            alone = run_to_completion(core, request)
            assert tokens(outs) == alone.token_ids, request.request_id
            assert outs[-1].finish_reason == alone.finish_reason
            if request.params.logprobs is not None:
                got = [lp for o in outs for lp in o.logprobs]
                assert len(got) == len(alone.token_ids) and all(len(lp.top) == request.params.logprobs for lp in got)
        assert core.scheduler.blocks.num_free_blocks == core.scheduler.config.num_blocks
        return core
    finally:
        core.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {f: str(build_tiny_checkpoint(f, root / f)) for f in MOE_FAMILIES + DENSE_FAMILIES}


@pytest.mark.parametrize("family", MOE_FAMILIES + DENSE_FAMILIES)
def test_batched_answers_equal_solo_answers(checkpoints, family):
    check_equal_to_solo(EngineConfig(model=checkpoints[family], max_model_len=128))


def test_chunked_prefill_and_an_offloaded_expert_cache_change_nothing(checkpoints):
    """5 tokens a step: every prompt but one is prefilled in chunks beside the others' decodes,
    and half the experts live in the CPU store."""
    check_equal_to_solo(EngineConfig(model=checkpoints["mixtral"], max_model_len=128, max_num_batched_tokens=5,
                                     gpu_expert_budget="50%"))


def test_preemption_recomputes_without_changing_answers(checkpoints):
    """KV for 80 tokens (5 blocks of 16): four 14-token prompts fill four blocks, and every one of
    them needs a second block within three tokens, so sequences are preempted and recomputed."""
    kv_bytes = 5 * 16 * kv_bytes_per_token(read_config(checkpoints["qwen3_moe"]), torch.float32)
    core = check_equal_to_solo(EngineConfig(model=checkpoints["qwen3_moe"], max_model_len=64,
                                            kv_cache_memory=str(kv_bytes)), reqs=requests((14,) * 6))
    assert core.scheduler.config.num_blocks == 5 and core.scheduler.num_preemptions > 0


def test_an_abort_frees_its_blocks_and_the_batch_goes_on(checkpoints):
    check_equal_to_solo(EngineConfig(model=checkpoints["olmoe"], max_model_len=128), abort="r1")


def test_a_request_that_fails_alone_fails_alone(checkpoints, monkeypatch):
    reqs = requests()
    core = EngineCore(EngineConfig(model=checkpoints["qwen2_moe"], max_model_len=128))
    execute = core.runtime.batch_runner.execute

    def failing_for_r2(chunks):
        if any(c.seq.request_id == "r2" for c in chunks):
            raise RuntimeError("r2 is poisoned")
        return execute(chunks)

    try:
        expected = {r.request_id: run_to_completion(core, r).token_ids for r in reqs if r.request_id != "r2"}
        monkeypatch.setattr(core.runtime.batch_runner, "execute", failing_for_r2)
        outputs = run_together(core, reqs)
        assert outputs["r2"][-1].finish_reason == "error" and "poisoned" in outputs["r2"][-1].error
        assert {rid: tokens(outs) for rid, outs in outputs.items() if rid != "r2"} == expected
        assert core.scheduler.blocks.num_free_blocks == core.scheduler.config.num_blocks
    finally:
        core.close()


def test_token_ids_outside_the_vocabulary_are_refused_at_once(checkpoints):
    core = EngineCore(EngineConfig(model=checkpoints["olmoe"], max_model_len=128))
    try:
        out = core.add_request(GenerateRequest("bad", (3, 128), SamplingParams(max_tokens=2)))
        assert out is not None and out.finish_reason == "error" and "[0, 128)" in out.error
        assert not core.has_unfinished()
    finally:
        core.close()


def close_enough(a: list[RequestOutput], b_tokens: list[int], b_top: list[set[int]]) -> bool:
    """vLLM's criterion for bf16: equal up to the first divergence, where each side's token is in
    the other's top-5."""
    a_tokens = tokens(a)
    a_top = [{t for t, _ in lp.top} for o in a for lp in o.logprobs]
    for i, (x, y) in enumerate(zip(a_tokens, b_tokens)):
        if x != y:
            return x in b_top[i] and y in a_top[i]
    return len(a_tokens) == len(b_tokens)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [None, "50%"])
def test_cuda_bf16_batched_answers_match_solo_answers(checkpoints, budget):
    """On the GPU (bf16, decode batches replayed as CUDA graphs, the Triton attention kernel)."""
    reqs = [GenerateRequest(r.request_id, r.prompt_ids, SamplingParams(max_tokens=r.params.max_tokens, temperature=0,
                                                                      logprobs=5)) for r in requests()]
    core = EngineCore(EngineConfig(model=checkpoints["qwen3_moe"], device="cuda", max_model_len=128,
                                   gpu_expert_budget=budget))
    try:
        together = run_together(core, reqs)
        assert core.runtime.batch_runner.graphs is not None and core.runtime.batch_runner.graphs.capture.graphs
        for request in reqs:
            outs = [o for o in together[request.request_id]]
            core.add_request(request)
            alone: list[RequestOutput] = []
            while core.has_unfinished():
                alone += core.step()
            solo_top = [{t for t, _ in lp.top} for o in alone for lp in o.logprobs]
            assert close_enough(outs, tokens(alone), solo_top), request.request_id
    finally:
        core.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("budget", [None, "50%"])
def test_cuda_graphed_mixed_steps_compute_what_eager_steps_compute(checkpoints, budget):
    """Steps that prefill short chunks beside decodes replay graphs (padded to token and sequence
    buckets) and give the eager steps' tokens and logprobs (fp32)."""
    reqs = [GenerateRequest(r.request_id, r.prompt_ids, SamplingParams(max_tokens=r.params.max_tokens, temperature=0,
                                                                      logprobs=5)) for r in requests()]
    answers = []
    for graphs in (False, True):
        core = EngineCore(EngineConfig(model=checkpoints["qwen3_moe"], device="cuda", dtype="float32",
                                       max_model_len=128, gpu_expert_budget=budget, cuda_graphs=graphs))
        try:
            answers.append(run_together(core, reqs))
            if graphs:  # the late arrivals' prefills ran beside decodes: token bucket > sequence bucket
                assert any(key[0] > key[1] for key in core.runtime.batch_runner.graphs.capture.graphs)
        finally:
            core.close()
    for request in reqs:
        eager, graphed = (answer[request.request_id] for answer in answers)
        assert tokens(graphed) == tokens(eager), request.request_id
        want = [lp.logprob for o in eager for lp in o.logprobs]
        got = [lp.logprob for o in graphed for lp in o.logprobs]
        assert got == pytest.approx(want, abs=1e-4)


def drain(core: EngineCore, outputs: dict[str, list[RequestOutput]], steps: int | None = None) -> None:
    while core.has_unfinished() and (steps is None or steps > 0):
        for out in core.step():
            assert out.error is None, out.error
            outputs.setdefault(out.request_id, []).append(out)
        steps = None if steps is None else steps - 1


class WheneverAlone(SpecSwitch):
    """Speculate on every lone step, whatever it costs, and never as a batch (the measured choice
    is tested in tests/engine/speculative/test_switch.py)."""

    def speculate(self, batch: int) -> bool:
        return batch == 1


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_speculating_alone_and_batching_together_change_no_greedy_answer(checkpoints, family):
    """Self-speculation (lossless) while a sequence runs alone, a batched step as soon as another
    arrives, speculation again once it is alone: its KV moves between the paged cache and the
    decoder's own both ways, and every token equals plain solo greedy decoding's."""
    reqs = [GenerateRequest(r.request_id, r.prompt_ids, SamplingParams(max_tokens=24 - 2 * i, temperature=0))
            for i, r in enumerate(requests()[:3])]
    plain = EngineCore(EngineConfig(model=checkpoints[family], max_model_len=128))
    try:
        expected = {r.request_id: run_to_completion(plain, r).token_ids for r in reqs}
    finally:
        plain.close()
    core = EngineCore(EngineConfig(model=checkpoints[family], max_model_len=128, spec="self", spec_tokens=3,
                                   gpu_expert_budget="50%"))
    core.spec_switch = WheneverAlone()  # on CPU plain decoding of tiny models may measure cheaper
    try:
        outputs: dict[str, list[RequestOutput]] = {}
        core.add_request(reqs[0])
        drain(core, outputs, steps=3)  # r0 alone: its prefill, then speculation
        assert core.runtime.spec_stats.verify_steps > 0
        for request in reqs[1:]:
            core.add_request(request)
        drain(core, outputs, steps=4)  # together: batched plain steps
        verified = core.runtime.spec_stats.verify_steps
        drain(core, outputs)  # the others finish first: r0 speculates again, alone
        assert core.runtime.spec_stats.verify_steps > verified
        assert {rid: tokens(outs) for rid, outs in outputs.items()} == expected
        assert core.scheduler.blocks.num_free_blocks == core.scheduler.config.num_blocks
    finally:
        core.close()
