"""Streaming a multi-token forward's experts through the cache: few copies, and the copy stream never idles.

A span of many tokens (a prefill, a decode step of many sequences) needs nearly every expert of
every layer, more than the cache holds, so its time is bounded below by the bytes of the experts
it misses over PCIe / host-to-device bandwidth. Three things keep those bytes few and the link busy:

  * kept experts: spans that follow each other (a large batch decoding) need every expert once a
    step, in layer order: a cycle. Belady's rule evicts the expert needed again last, on a cycle
    the one its layer just ran, so a fixed set of experts stays resident and only the others are
    copied, once a step each; recency (LRU) evicts exactly what comes next and hits ~0%, and a
    layer that pins all of its experts at once (a piecewise-graph replay) leaves at most C - E
    expert slots to keep anything in. So a streamed run keeps its layer's share of
    `StreamExpertSlots.kept` (the resident experts first, ExpertSlotTable.keep: never victims) and
    streams the others through the remaining expert slots: the fewest that double-buffer, two
    waves each big enough that its copy outlasts the host work of computing it (MIN_WAVE_BYTES).
    The eviction policy only chooses among those, so any policy gets the cycle's hits. At Mixtral
    size (352 MB experts, 12 expert slots for 6 layers x 8 experts) 10 experts stay and a step that
    needs all 48 copies 38.
  * within a layer: its kept experts form the first wave, computed while the next wave's copies
    fly; each wave is acquired (its demand copies started) before the one before it computes:
    double buffering. Small experts (two waves take the whole cache) keep nothing and stream in
    waves of half the cache.
  * across layers: a streamed span reads back, with its routing, the next layer's experts ranked
    by how much the tokens' gate guess (the next router applied to this layer's hidden state)
    routes to them. Once nothing of this layer is left to copy, each wave it releases makes room
    for them (ExpertCache.prefetch within_room: never a kept expert, never a pinned one), so they
    fly during this layer's last waves, the next layer's attention and its routing read-back.
    Copies into the expert slots just released wait for the compute reading them (cache.py's
    write-after-read markers); in-flight expert slots are never victims (expert_slots.py).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moe_serve.engine.experts.cache import ExpertCache, Wave
from moe_serve.engine.experts.predictor import Guess, rank_by_impact, token_topk
from moe_serve.engine.experts.routing import Router


def streams(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a span of `tokens` streams: keeps experts, double-buffers waves, prefetches the next
    layer's guess.

    When its tokens pick every expert twice over on average (T·k ≥ 2E), uniform routing already
    needs 1 - (1 - k/E)^T ≥ 1 - e^-2 ≈ 86% of the next layer's experts, so prefetching all the
    guessed ones is hardly ever a wasted copy or a harmful eviction, and a kept expert is needed
    by most runs of its layer. Shorter spans (decode, speculative verify) keep the next-layer
    predictor's few best guesses, or none, and nothing stays kept for them."""
    return tokens * top_k >= 2 * num_experts


def saturates(tokens: int, top_k: int, num_experts: int, num_layers: int) -> bool:
    """Whether a span of `tokens` needs every expert of the model: a uniform router leaves a given
    expert of a layer unused with probability (1 - k/E)^T, so fewer than one of the model's L·E
    experts is expected unused once L·E·(1 - k/E)^T < 1. The demand of spans like it is then the
    known cycle the kept experts are chosen for, not a guess. (6 layers x 8 experts, top-2: from
    14 tokens; 16 x 64, top-8: from 52.)"""
    return num_layers * num_experts * (1 - top_k / num_experts) ** tokens < 1


# A wave is computed by one accumulate_experts call, whose host syncs take ~0.4 ms on an H100
# (runner._compute): ~20 MB of copy at ~50 GB/s. A wave that copies at least this much keeps the
# copy stream ahead of the host; 352 MB Mixtral experts stream one at a time.
MIN_WAVE_BYTES = 32 * 2**20


@dataclass(frozen=True)
class StreamExpertSlots:
    """How streamed spans share the cache: `kept` expert slots hold experts that stay resident from
    one streamed run of their layer to the next, spread evenly over the layers; the other expert
    slots, two waves or more, stream the rest (layer_waves)."""

    kept: int
    num_layers: int

    @classmethod
    def of(cls, capacity: int, expert_bytes: int, num_layers: int,
           min_wave_bytes: int = MIN_WAVE_BYTES) -> StreamExpertSlots:
        """All but two waves of the fewest experts that copy `min_wave_bytes` (none if those take the cache)."""
        wave = max(1, -(-min_wave_bytes // expert_bytes))
        return cls(max(0, capacity - 2 * wave), num_layers)

    def quota(self, layer: int) -> int:
        """`layer`'s share of the kept expert slots. Evenly: every layer then streams some experts,
        which the layer before prefetches, and computes its kept ones while they land."""
        share, extra = divmod(self.kept, self.num_layers)
        return share + (layer < extra)


def stream_guess(x: torch.Tensor, router_weight: torch.Tensor, top_k: int, target: int, limit: int,
                 router: Router = Router(), correction: torch.Tensor | None = None,
                 logit_bias: torch.Tensor | None = None) -> Guess:
    """Layer `target`'s experts for a streamed span whose hidden state entering the layer before is
    x [T, H]: the union of each token's gate guess (chosen as `router` chooses, with `correction`)
    ranked by summed score, at most `limit` (the cache's capacity: a longer list would only evict
    its own head). No host sync."""
    probs, ids = token_topk(x, router_weight, top_k, router, correction, logit_bias)  # [T, k] each
    num_experts = router_weight.shape[0]
    ranked = rank_by_impact(probs.reshape(1, -1), ids.reshape(1, -1), num_experts, limit)  # [1, m]
    return Guess(range(target, target + 1), (probs[:, None], ids[:, None]), ranked)


def layer_waves(cache: ExpertCache, layer: int, experts: list[int], *, double_buffer: bool = True, keep: int = 0,
                tail: Callable[[], None] | None = None) -> Iterator[Wave]:
    """`layer`'s `experts` as pinned waves; each is released when the caller asks for the next one
    (so after the caller enqueued its compute) or closes the iterator.

    `keep` of them (the ones kept already first, then the other resident ones) become the layer's
    kept experts (ExpertCache.keep) and the first wave. The others go through the expert slots
    nothing keeps: if they fit, in one more wave, and a later one only for experts that found
    every expert slot in flight. If not (and `double_buffer`): waves of half those expert slots,
    the next acquired before the current one is yielded: two waves pinned at once hold at most
    those expert slots, so the second acquire always has an expert slot this layer did not pin to
    wait for. Resident experts go first, so
    that no demand copy evicts an expert that a later wave of this layer would have hit.
    `tail` is called after each release that leaves nothing of the layer to acquire."""
    kept = _kept_first(cache, layer, experts)[:keep] if keep else []
    if keep:
        cache.keep(layer, kept)
    others = [e for e in experts if e not in kept]
    streaming = cache.capacity - cache.kept  # expert slots free for the others, at least
    double = double_buffer and len(others) > streaming >= 2
    size = streaming // 2 if double else max(1, len(others))
    todo = _kept_first(cache, layer, others) if double else others
    depth = 2 if double or kept else 1  # waves pinned at once
    held: deque[Wave] = deque()
    try:
        if kept:
            held.append(cache.acquire(layer, kept))
            todo = held[0].leftover + todo
        while todo or held:
            while todo and len(held) < depth:
                wave = cache.acquire(layer, todo[:size])
                held.append(wave)
                todo = wave.leftover + todo[size:]
            yield held[0]
            cache.release(held.popleft())
            if tail is not None and not todo:
                tail()
    finally:
        for wave in held:
            cache.release(wave)


def _kept_first(cache: ExpertCache, layer: int, experts: list[int]) -> list[int]:
    """Resident experts (kept ones first), then missing ones; stable: the caller's order within each group."""
    missing = set(cache.missing(layer, experts))
    return sorted(experts, key=lambda e: (e in missing, not cache.is_kept(layer, e)))
