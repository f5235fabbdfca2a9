"""The static-shape forward that CUDA graphs capture computes what the eager forward computes."""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.graphs import batch_bucket, span_bucket, step_shapes
from moe_serve.engine.kv.paged_attention import PREFILL_RUN_MIN_QUERIES
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.runtime import build_runtime
from tests.tiny_checkpoints import build_tiny_checkpoint

PROMPT = [3, 17, 42, 5, 99, 7]


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe", "mistral"])
def test_static_forward_matches_eager(tmp_path, family):
    runtime = build_runtime(EngineConfig(model=str(build_tiny_checkpoint(family, tmp_path / family))))
    model, cfg = runtime.target.model, runtime.model_config
    eager = runtime.target.kv
    static = KVCache.for_model(cfg, eager.max_len, device="cpu", dtype=torch.float32)
    tokens = torch.tensor(PROMPT)
    model(tokens, 0, eager)
    model(tokens, 0, static)
    for step, token in enumerate([11, 23, 5, 64]):
        pos = static.length
        want = model(torch.tensor([token]), pos, eager)  # [1, V]
        got = model.forward_static(torch.tensor([token]), torch.tensor([pos]), span_bucket(pos + 1, static.max_len),
                                   static, moe_top_r=None)
        static.length = pos + 1
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    span = [8, 90, 31]  # a verify pass: several queries, each masked to its own past
    pos = static.length
    want = model(torch.tensor(span), pos, eager)  # [3, V]
    got = model.forward_static(torch.tensor(span), torch.arange(pos, pos + 3), span_bucket(pos + 3, static.max_len),
                               static, moe_top_r=None)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    runtime.close()


def test_span_buckets():
    assert span_bucket(1, 4096) == 256
    assert span_bucket(257, 4096) == 512
    assert span_bucket(3000, 2048) == 2048


@pytest.mark.parametrize("max_num_seqs,max_num_batched_tokens", [(64, 2048), (5, 40), (1, 300), (200, 150)])
def test_step_shapes_cover_every_step_a_scheduler_can_form(max_num_seqs, max_num_batched_tokens):
    shapes = step_shapes(max_num_seqs, max_num_batched_tokens)
    buckets = [(batch_bucket(sum(lengths)), batch_bucket(len(lengths))) for lengths in shapes]
    assert len(set(buckets)) == len(buckets)  # one step per shape
    for lengths in shapes:
        assert len(lengths) <= max_num_seqs and sum(lengths) <= max_num_batched_tokens
        assert 1 <= min(lengths) and max(lengths) < PREFILL_RUN_MIN_QUERIES
    reachable = {(batch_bucket(t), batch_bucket(s))
                 for s in range(1, max_num_seqs + 1)
                 for t in range(s, min(s * (PREFILL_RUN_MIN_QUERIES - 1), max_num_batched_tokens) + 1)
                 if batch_bucket(t) is not None}  # more tokens than the largest bucket run eagerly
    assert set(buckets) == reachable


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_batched_step_shapes_are_captured_at_start_up(tmp_path):
    from moe_serve.engine.core import EngineCore
    from moe_serve.engine.messages import GenerateRequest, SamplingParams

    path = str(build_tiny_checkpoint("qwen3_moe", tmp_path / "m"))
    core = EngineCore(EngineConfig(model=path, device="cuda", dtype="float32", max_num_seqs=8,
                                   max_num_batched_tokens=64))
    graphs = core.runtime.batch_runner.graphs.capture.graphs
    captured = set(graphs)
    assert len(captured) == len(step_shapes(8, 64))
    assert core.runtime.generation_stats(ttft_seconds=None, tpot_seconds=None)["expert_hits"] == 0
    for i in range(8):
        prompt = tuple(PROMPT[: 2 + i % 5]) * (1 + i) if i else tuple(PROMPT) * 30
        assert core.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0))) is None
    while core.has_unfinished():
        core.step()
    assert set(graphs) == captured  # served without a capture
    assert not core.runtime.batch_runner.graphs.spans_differ  # Triton attention: one capture serves any span
    core.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_verify_passes_and_self_drafts_of_a_batch_are_captured_at_start_up(tmp_path):
    from moe_serve.engine.core import EngineCore
    from moe_serve.engine.messages import GenerateRequest, SamplingParams
    from moe_serve.engine.speculative.switch import SpecSwitch

    class AsABatch(SpecSwitch):
        def speculate(self, batch: int) -> bool:
            return batch > 1

    path = str(build_tiny_checkpoint("qwen3_moe", tmp_path / "m"))
    core = EngineCore(EngineConfig(model=path, device="cuda", dtype="float32", max_num_seqs=8,
                                   max_num_batched_tokens=64, spec="self", spec_tokens=3))
    core.spec_switch = AsABatch()
    graphs = core.runtime.batch_runner.graphs.capture.graphs
    captured = set(graphs)
    assert {key[-1] for key in captured} == {None, 1}  # all experts, and the self-draft's top-r = 1
    assert any(rows > seqs for _, seqs, rows, _, _ in captured)  # verify passes read every token's row
    for i in range(6):
        prompt = tuple(PROMPT[: 2 + i % 5]) * (1 + i)
        assert core.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=20, temperature=0))) is None
    while core.has_unfinished():
        core.step()
    assert core.runtime.spec_stats.verify_steps > 0
    assert set(graphs) == captured  # served without a capture
    core.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_decode_matches_eager_on_gpu(tmp_path):
    from moe_serve.engine.core import EngineCore
    from moe_serve.engine.messages import GenerateRequest, SamplingParams

    path = str(build_tiny_checkpoint("qwen3_moe", tmp_path / "m"))
    outs = []
    for graphs in (False, True):
        core = EngineCore(EngineConfig(model=path, device="cuda", dtype="float32", cuda_graphs=graphs))
        assert (core.runtime.target.graphs is not None) == graphs
        params = SamplingParams(max_tokens=40, temperature=0)
        assert core.add_request(GenerateRequest("g", tuple(PROMPT), params)) is None
        token_ids = [t for out in core.step() for t in out.new_token_ids]  # the prompt and its first token
        # hits counted from here: an eager prompt of fp32 experts took the cache's path, which
        # books each distinct expert once, where a replay books T x k (GraphCapture._replay)
        core.runtime.reset_stats()
        while core.has_unfinished():
            token_ids += [t for out in core.step() for t in out.new_token_ids]
        stats = core.runtime.generation_stats(ttft_seconds=None, tpot_seconds=None)
        outs.append((token_ids, stats["expert_hits"]))
        core.close()
    assert outs[0] == outs[1]  # same tokens, and replays are counted like eager steps


def test_a_replayed_token_books_its_experts_in_every_layer(tmp_path):
    runtime = build_runtime(EngineConfig(model=str(build_tiny_checkpoint("olmoe", tmp_path / "m"))))
    try:
        before = runtime.runner.stats().column("hits")
        runtime.runner.count_replayed_tokens(1, 3)
        after = runtime.runner.stats().column("hits")
    finally:
        runtime.close()
    assert [a - b for a, b in zip(after, before)] == [3] * runtime.model_config.num_moe_layers


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("family,policy,prefetch", [
    ("olmoe", "lru", "none"), ("qwen2_moe", "mrs", "none"), ("mixtral", "lfu", "none"),
    ("olmoe", "lru", "next-layer"), ("qwen3_moe", "mrs", "next-layer"),
])
def test_piecewise_graphs_of_an_offloaded_step_match_eager(tmp_path, family, policy, prefetch):
    from moe_serve.engine.core import EngineCore, run_to_completion
    from moe_serve.engine.messages import GenerateRequest, SamplingParams

    path = str(build_tiny_checkpoint(family, tmp_path / "m"))
    runs = []
    for graphs in (False, True):
        core = EngineCore(EngineConfig(model=path, device="cuda", dtype="float32", cuda_graphs=graphs,
                                       gpu_expert_budget="30%", cache_policy=policy, prefetch=prefetch))
        assert (core.runtime.target.graphs is not None) == graphs
        assert not graphs or core.runtime.target.graphs.piecewise
        params = SamplingParams(max_tokens=120, temperature=0)
        done = run_to_completion(core, GenerateRequest("g", tuple(PROMPT), params))
        stats = core.runtime.generation_stats(ttft_seconds=None, tpot_seconds=None)
        runs.append((done.token_ids, stats))
        core.close()
    (eager, eager_stats), (graphed, graphed_stats) = runs
    assert graphed == eager
    assert graphed_stats["expert_misses"] > 0
    if prefetch == "none":  # the same cache decisions in the same order; prefetch timing may differ
        assert (graphed_stats["expert_hits"], graphed_stats["expert_misses"]) == \
            (eager_stats["expert_hits"], eager_stats["expert_misses"])
