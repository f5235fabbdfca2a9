"""The same guarantees on CUDA, where prefetch tasks carry events and copies run on their own stream."""
from __future__ import annotations

import pytest
import torch
from spec_harness import (
    assert_kv_matches_prefill,
    bind,
    generate,
    generate_with_worker_prefetch,
    load_cached,
    load_dense,
)

from engine.decode import PlainDecoder
from engine.messages import SamplingParams
from engine.spec.config import SpecConfig
from engine.spec.draft_spec import DraftSpecDecoder
from engine.spec.self_spec import SelfSpecDecoder
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
    seq, bound, prefetched = generate_with_worker_prefetch(target, draft, PROMPT, GREEDY)
    assert seq.output_ids == reference
    assert prefetched > 0
    assert_kv_matches_prefill(bound, seq.all_ids[:-1])


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_cuda_graphed_drafts_keep_greedy_exact(checkpoint, family: str) -> None:
    """Every expert resident: one-token drafts (top-r included) replay CUDA graphs, verify runs eager."""
    target = load_cached(checkpoint(family), CUDA, all_resident=True)
    plain = bind(target)
    reference = generate(PlainDecoder(plain), plain, PROMPT, GREEDY).output_ids
    bound = bind(target, graphs=True)
    draft = bind(load_dense(checkpoint("llama", seed=3), CUDA), graphs=True)
    for decoder in (SelfSpecDecoder(bound, SpecConfig(gamma=3)), DraftSpecDecoder(bound, draft, SpecConfig(gamma=3))):
        seq = generate(decoder, bound, PROMPT, GREEDY)
        assert seq.output_ids == reference
        assert_kv_matches_prefill(bound, seq.all_ids[:-1])
    assert bound.graphs.graphs and draft.graphs.graphs, "the drafts were meant to replay graphs"
