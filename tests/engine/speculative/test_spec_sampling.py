"""Speculative sampling through the whole loop gives plain sampling's joint distribution.

Target and draft are bigram tables over 4 tokens (fast enough for thousands of samples); the
reference is the exact probability of every continuation under plain sampling, computed with the
same penalty / temperature / top-k / top-p functions plain decoding uses.
"""
from __future__ import annotations

import itertools
from collections import Counter
from math import sqrt

import torch

from moe_serve.engine.decode import BoundModel
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.messages import SamplingParams
from moe_serve.engine.sampling import apply_penalties, target_distribution
from moe_serve.engine.sequence import Sequence
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.loop import Drafter, SpecDecoder

VOCAB = 4
PROMPT = [0]
FIRST = 1  # the first output token, taken as given: the spec steps come after it
NEW = 3  # tokens the spec steps must produce
PARAMS = SamplingParams(max_tokens=1 + NEW, temperature=0.8, top_k=3, top_p=0.95,
                        presence_penalty=0.4, frequency_penalty=0.3)
CPU = torch.device("cpu")


class BigramLM:
    """Logits depend on the previous token only; keeps the KV contract (start must equal length)."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # [V, V] logits of the next token given the previous one

    def __call__(self, input_ids: torch.Tensor, start: int, kv: KVCache, *, last_only: bool = False,
                 on_attention_output: object = None) -> torch.Tensor:
        if start != kv.length:
            raise ValueError(f"start {start} != kv.length {kv.length}")
        kv.length = start + input_ids.shape[0]
        logits = self.table[input_ids]  # [T, V]
        return logits[-1:] if last_only else logits


def bound(lm: BigramLM) -> BoundModel:
    return BoundModel(lm, KVCache(1, 16, 1, 1, device=CPU, dtype=torch.float32), CPU)


def exact_distribution(lm: BigramLM) -> dict[tuple[int, ...], float]:
    """P(continuation) under plain sampling: the product of each position's target distribution."""
    exact = {}
    for tokens in itertools.product(range(VOCAB), repeat=NEW):
        counts, prev, prob = Counter([FIRST]), FIRST, 1.0
        for token in tokens:
            probs = target_distribution(apply_penalties(lm.table[prev], PARAMS, counts), PARAMS)
            prob *= float(probs[token])
            counts[token] += 1
            prev = token
        exact[tokens] = prob
    return exact


def sample_continuations(decoder: SpecDecoder, target: BoundModel, samples: int) -> Counter[tuple[int, ...]]:
    seen: Counter[tuple[int, ...]] = Counter()
    for i in range(samples):
        decoder.reset()
        seq = Sequence("s", list(PROMPT), PARAMS, seed=2024 + i)  # a seed per sample: independent draws
        target.forward(PROMPT)  # the prefill; FIRST is its (given) token
        seq.append(FIRST, None, 64)
        while seq.finish_reason is None:
            decoder.step(seq, 64)
        seen[tuple(seq.output_ids[1:])] += 1
    return seen


def chi_square_bound(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: p = 0.9995)."""
    return df * (1 - 2 / (9 * df) + z * sqrt(2 / (9 * df))) ** 3


def test_spec_sampling_matches_plain_sampling_jointly() -> None:
    gen = torch.Generator().manual_seed(1)
    table = 2.0 * torch.randn(VOCAB, VOCAB, generator=gen)  # [V, V]
    target_lm, draft_lm = BigramLM(table), BigramLM(table + torch.randn(VOCAB, VOCAB, generator=gen))
    target = bound(target_lm)
    decoder = SpecDecoder(target, Drafter(bound(draft_lm)), SpecConfig(gamma=2))
    samples = 4000
    seen = sample_continuations(decoder, target, samples)
    exact = exact_distribution(target_lm)

    assert all(exact[c] > 0 for c in seen), "a continuation plain sampling can never produce was emitted"
    # Pearson chi-square over continuations expected at least 5 times, the rest pooled
    big = [c for c in exact if exact[c] * samples >= 5]
    observed = [seen[c] for c in big] + [samples - sum(seen[c] for c in big)]
    expected = [exact[c] * samples for c in big] + [samples * (1 - sum(exact[c] for c in big))]
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    assert statistic < chi_square_bound(len(big))
    total_variation = 0.5 * sum(abs(seen[c] / samples - exact[c]) for c in exact)
    assert total_variation < 0.06
    # the run exercised keeping, correcting and the bonus token
    stats = decoder.stats
    assert 0 < stats.accepted_tokens < stats.draft_tokens and stats.accepted_at_position[0] > 0
