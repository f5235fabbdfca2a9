"""The same guarantees on CUDA, where prefetch tasks carry events and copies run on their own stream."""
from __future__ import annotations

import pytest
import torch
from spec_harness import (
    assert_kv_matches_prefill,
    bind,
    generate,
    generate_with_prefetch,
    load_cached,
    load_dense,
)

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore, run_to_completion
from moe_serve.engine.decode import PlainDecoder
from moe_serve.engine.messages import GenerateRequest, SamplingParams
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.draft_spec import DraftSpecDecoder
from moe_serve.engine.speculative.self_spec import SelfSpecDecoder
from tests.tiny_checkpoints import MOE_FAMILIES

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = [9, 33, 2, 101, 54, 7]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
CUDA = torch.device("cuda")


@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("mode", ["self", "draft"])
def test_cuda_speculative_prefetch_keeps_greedy_exact(checkpoint, family: str, mode: str) -> None:
    target = load_cached(checkpoint(family), CUDA)
    plain = bind(target)
    reference = generate(PlainDecoder(plain), plain, PROMPT, GREEDY).output_ids
    draft = load_dense(checkpoint("llama", seed=3), CUDA) if mode == "draft" else None
    seq, bound, prefetched = generate_with_prefetch(target, draft, PROMPT, GREEDY)
    assert seq.output_ids == reference
    assert prefetched > 0
    assert_kv_matches_prefill(bound, seq.all_ids[:-1])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_cuda_graphed_drafts_keep_greedy_exact(checkpoint, family: str) -> None:
    """Every expert resident: drafts (top-r included) and verify spans replay one-piece CUDA graphs."""
    target = load_cached(checkpoint(family), CUDA, all_resident=True)
    plain = bind(target)
    reference = generate(PlainDecoder(plain), plain, PROMPT, GREEDY).output_ids
    bound = bind(target, graphs=True)
    draft = bind(load_dense(checkpoint("llama", seed=3), CUDA), graphs=True)
    for decoder in (SelfSpecDecoder(bound, SpecConfig(gamma=3)), DraftSpecDecoder(bound, draft, SpecConfig(gamma=3))):
        seq = generate(decoder, bound, PROMPT, GREEDY)
        assert seq.output_ids == reference
        assert_kv_matches_prefill(bound, seq.all_ids[:-1])
    assert draft.graphs.graphs, "the drafts were meant to replay graphs"
    assert any(key.tokens > 1 for key in bound.graphs.graphs), "the verify spans were meant to replay graphs"


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe"])
@pytest.mark.parametrize("mode", ["self", "draft"])
def test_cuda_piecewise_graphed_speculation_keeps_greedy_exact(checkpoint, family: str, mode: str) -> None:
    """Experts offloaded, speculative prefetch on: drafts (with the predictor's hook) and verify
    spans replay piecewise graphs, and the tokens are plain greedy's."""
    common = dict(model=str(checkpoint(family)), device="cuda", dtype="float32", gpu_expert_budget="50%")
    params = SamplingParams(max_tokens=60, temperature=0)
    request = GenerateRequest("g", tuple(PROMPT), params)
    plain = EngineCore(EngineConfig(**common, cuda_graphs=False))
    reference = run_to_completion(plain, request).token_ids
    plain.close()
    core = EngineCore(EngineConfig(**common, spec=mode, spec_tokens=3, spec_cutoff=99,
                                   draft=str(checkpoint("llama", seed=3)) if mode == "draft" else None))
    try:
        tokens = run_to_completion(core, request).token_ids
        stats = core.runtime.generation_stats(ttft_seconds=None, tpot_seconds=None)
        keys = list(core.runtime.target.graphs.graphs)
        assert core.runtime.target.graphs.piecewise
    finally:
        core.close()
    assert tokens == reference
    assert any(key.tokens > 1 for key in keys), "verify spans were meant to replay graphs"
    if mode == "self":
        assert any(key.hook is not None and key.top_r is not None for key in keys), "drafts were meant to replay"
    assert stats["prediction_accuracy"] is not None and stats["expert_misses"] > 0
