"""Streaming a multi-token forward's experts through the cache so that the copy stream never idles.

A prefill of many tokens needs nearly every expert of every layer, more than the cache holds, so
its time is bounded below by the bytes of the experts it misses over PCIe / host-to-device
bandwidth. Two things keep the link busy between and within layers:

  * across layers: a streamed span reads back, with its routing, the next layer's experts ranked
    by how much the tokens' gate guess (the next router applied to this layer's hidden state)
    routes to them; once this layer's compute is enqueued and its experts released, the runner
    prefetches them, so they fly during this layer's tail compute, the next layer's attention and
    its routing read-back. Copies into the slots just released wait for the compute reading them
    (cache.py's write-after-read markers); pinned and in-flight slots are never victims (slots.py).
    After the release rather than before the compute: the whole cache, this layer's slots too, is
    open to the next layer, and the host gets there right after this layer's last copy landed
    (grouped compute reads its routing back once that copy is waited for), so the link idles for
    about one host round trip per layer.
  * within a layer that needs more experts than the cache holds: waves of half the cache, each
    acquired (its demand copies started) before the one before it computes, so wave i+1's copies
    fly while wave i computes: double buffering.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterator

import torch

from moe_serve.engine.experts.cache import ExpertCache, Wave
from moe_serve.engine.experts.predictor import Guess, rank_by_impact, token_topk


def streams(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a span of `tokens` streams: prefetches the next layer's guess, double-buffers waves.

    When its tokens pick every expert twice over on average (T·k ≥ 2E), uniform routing already
    needs 1 - (1 - k/E)^T ≥ 1 - e^-2 ≈ 86% of the next layer's experts, so prefetching all the
    guessed ones is hardly ever a wasted copy or a harmful eviction. Shorter spans (decode,
    speculative verify) keep the next-layer predictor's few best guesses, or none."""
    return tokens * top_k >= 2 * num_experts


def stream_guess(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, target: int, limit: int) -> Guess:
    """Layer `target`'s experts for a streamed span whose hidden state entering the layer before is
    x [T, H]: the union of each token's gate guess ranked by summed probability, at most `limit`
    (the cache's capacity: a longer list would only evict its own head). No host sync."""
    probs, ids = token_topk(x, router_weight, top_k)  # [T, k] each
    num_experts = router_weight.shape[0]
    ranked = rank_by_impact(probs.reshape(1, -1), ids.reshape(1, -1), num_experts, limit)  # [1, m]
    return Guess(range(target, target + 1), (probs[:, None], ids[:, None]), ranked)


def layer_waves(cache: ExpertCache, layer: int, experts: list[int], *, double_buffer: bool = True) -> Iterator[Wave]:
    """`layer`'s `experts` as pinned waves; each is released when the caller asks for the next one
    (so after the caller enqueued its compute) or closes the iterator.

    If they all fit: one wave, and a later one only for experts that found every slot in flight.
    If not (and `double_buffer`): waves of half the cache, the next acquired before the current
    one is yielded: two waves pinned at once hold at most the cache, so the second acquire always
    has a slot this layer did not pin to wait for. Resident experts go first, so that no
    demand copy evicts an expert that a later wave of this layer would have hit."""
    double = double_buffer and len(experts) > cache.capacity >= 2
    size = cache.capacity // 2 if double else len(experts)
    todo = _resident_first(cache, layer, experts) if double else list(experts)
    depth = 2 if double else 1  # waves pinned at once
    held: deque[Wave] = deque()
    try:
        while todo or held:
            while todo and len(held) < depth:
                wave = cache.acquire(layer, todo[:size])
                held.append(wave)
                todo = wave.leftover + todo[size:]
            yield held[0]
            cache.release(held.popleft())
    finally:
        for wave in held:
            cache.release(wave)


def _resident_first(cache: ExpertCache, layer: int, experts: list[int]) -> list[int]:
    missing = set(cache.missing(layer, experts))
    return sorted(experts, key=lambda e: e in missing)  # stable: the caller's order within each group
