"""Every KVAttention a model attends through (one sequence's eager and static-shape forwards, a
paged batch step) with gpt-oss's attention sinks, against transformers' eager math.

One sequence is fed as a prefill from 0, a decode token and a verify span, so SequenceAttention
meets both its maskless cases (is_causal's prefill, a lone query) and explicit masks.
"""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.kv.paged_cache import PagedKVCache, PagedStep, StepLayout
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.models.blocks import SequenceAttention, attention_mask, static_attention_mask
from tests.engine.kv.test_paged_attention import eager_attention_with_sinks

NKV, G, D = 2, 2, 8  # GQA: each kv head serves 2 of the 4 query heads
STEPS = [(0, 5), (5, 1), (6, 3)]  # (start, tokens): a prefill from 0, a decode token, a verify span
LENGTH = 9
SPAN = 12  # the static forward's key bucket, past the sequence's end
BLOCK_SIZE = 5  # divides no step's end
SCALE = 0.3


def sequence_attention(kv: KVCache, start: int, n: int, window: int | None) -> SequenceAttention:
    # explicit, as CausalLM.forward builds them for a model with sinks
    return SequenceAttention(kv, start, {window: attention_mask(start, n, window, torch.device("cpu"), explicit=True)})


def static_sequence_attention(kv: KVCache, start: int, n: int, window: int | None) -> SequenceAttention:
    positions = torch.arange(start, start + n)
    return SequenceAttention(kv, 0, {window: static_attention_mask(positions, SPAN, window)}, positions, SPAN)


def paged_step(cache: PagedKVCache, start: int, n: int, window: int | None) -> PagedStep:
    table = [2, 0, 3]  # blocks out of order
    return PagedStep.build(cache, StepLayout.of([(table, start, n)], BLOCK_SIZE), torch.device("cpu"))


ATTENTIONS = {
    "sequence": (lambda: KVCache(1, SPAN, NKV, D, device="cpu", dtype=torch.float32), sequence_attention),
    "static": (lambda: KVCache(1, SPAN, NKV, D, device="cpu", dtype=torch.float32), static_sequence_attention),
    "paged": (lambda: PagedKVCache(1, 4, BLOCK_SIZE, NKV, D, device="cpu", dtype=torch.float32), paged_step),
}


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("kind", ATTENTIONS)
def test_attention_with_sinks_matches_the_eager_reference(kind, window):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(LENGTH, NKV * G, D, generator=gen)  # [T, nq, D]
    k = torch.randn(LENGTH, NKV, D, generator=gen)
    v = torch.randn(LENGTH, NKV, D, generator=gen)
    sinks = torch.randn(NKV * G, generator=gen)  # fp32 [nq]
    make_cache, make_attention = ATTENTIONS[kind]
    cache = make_cache()
    for start, n in STEPS:
        rows = slice(start, start + n)
        got = make_attention(cache, start, n, window).attend(0, window, q[rows], k[rows], v[rows], SCALE, sinks)
        k_pos = torch.arange(start + n)[None, :]  # [1, S]
        q_pos = torch.arange(start, start + n)[:, None]  # [n, 1]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - (window or LENGTH))  # [n, S]
        per_head = [x[:start + n].repeat_interleave(G, dim=1).transpose(0, 1) for x in (k, v)]  # [nq, S, D] each
        want = eager_attention_with_sinks(q[rows].transpose(0, 1), *per_head, mask, SCALE, sinks)  # [nq, n, D]
        torch.testing.assert_close(got, want.transpose(0, 1).reshape(n, -1), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, at=start: f"step at {at}: {m}")
