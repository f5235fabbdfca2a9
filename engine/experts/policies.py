"""Eviction policies of the expert cache: which resident expert leaves when a slot is needed.

Plain Python, no torch: the live ExpertCache (through SlotTable) and the offline replay use the
same objects, so a hit rate measured by replay is the hit rate the server would see.

LFU and MRS rank candidates by a tuple whose last element is the last-use stamp, so their ties
fall back to LRU (temporal locality dominates MoE routing, see the EBCO report).

Next-use estimates when each candidate is needed again from the order a forward runs the MoE
layers in (0, 1, ..., L-1, then 0 again), which LRU ignores: an expert of the layer after the
current one is needed within one layer run if it is routed to again; one of the layer that just
ran waits a whole forward. When a forward needs more experts than the cache holds (a verify pass
over many tokens) LRU evicts exactly the experts that come next and hits ~0%; next-use keeps them.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Protocol

Key = tuple[int, int]  # (moe layer, expert id)

POLICY_NAMES = ("lru", "lfu", "mrs", "next-use")


class EvictionPolicy(Protocol):
    def begin_run(self, layer: int) -> None:
        """A run of MoE layer `layer` asks for its experts (once per wave)."""

    def admit(self, key: Key) -> None:
        """`key` became resident (demand copy or prefetch)."""

    def touch(self, key: Key) -> None:
        """Compute used `key`."""

    def evicted(self, key: Key) -> None:
        """`key` left the cache."""

    def observe_scores(self, layer: int, scores: Sequence[float]) -> None:
        """Router scores of one run of `layer`, one float per expert."""

    def victims(self, candidates: Collection[Key], n: int) -> list[Key]:
        """Up to `n` of `candidates` (resident keys) to evict, first victim first."""


class LRUPolicy:
    """Least recently used: evicts the expert whose last use (or admission) is oldest."""

    def __init__(self) -> None:
        self._clock = 0
        self._stamp: dict[Key, int] = {}
        self._recency: OrderedDict[Key, None] = OrderedDict()  # resident keys, least recent first

    def begin_run(self, layer: int) -> None:
        pass  # recency only

    def admit(self, key: Key) -> None:
        self._bump(key)

    def touch(self, key: Key) -> None:
        self._bump(key)

    def evicted(self, key: Key) -> None:
        self._recency.pop(key, None)

    def observe_scores(self, layer: int, scores: Sequence[float]) -> None:
        pass  # recency only

    def victims(self, candidates: Collection[Key], n: int) -> list[Key]:
        # walk from the least recent end: only pinned / in-flight keys are skipped, so this is
        # O(n) in practice where a full ranking would be O(cache size) per miss
        picked: list[Key] = []
        for key in self._recency:
            if len(picked) == n:
                break
            if key in candidates:
                picked.append(key)
        return picked

    def _bump(self, key: Key) -> None:
        self._clock += 1
        self._stamp[key] = self._clock
        self._recency[key] = None
        self._recency.move_to_end(key)


class _RankedPolicy(LRUPolicy):
    """Evicts the smallest `_rank`, a tuple ending in the last-use stamp (ties -> LRU)."""

    def victims(self, candidates: Collection[Key], n: int) -> list[Key]:
        return heapq.nsmallest(n, candidates, key=self._rank)

    def _rank(self, key: Key) -> tuple:
        raise NotImplementedError


class LFUPolicy(_RankedPolicy):
    """Least frequently used over the whole run (counts survive eviction); ties -> LRU."""

    def __init__(self) -> None:
        super().__init__()
        self._uses: dict[Key, int] = {}

    def touch(self, key: Key) -> None:
        self._uses[key] = self._uses.get(key, 0) + 1
        super().touch(key)

    def _rank(self, key: Key) -> tuple:
        return (self._uses.get(key, 0), self._stamp.get(key, 0))


class MRSPolicy(_RankedPolicy):
    """HybriMoE Minus Recent Score: S = alpha * TopP(s) + (1 - alpha) * S per layer.

    s are the router scores of the layer's latest run; only its top-p entries accumulate (p is
    twice the experts a token activates), every expert's S decays. Evicts the lowest S.
    """

    def __init__(self, top_p: int, alpha: float = 0.3) -> None:
        if top_p < 1 or not 0 < alpha <= 1:
            raise ValueError(f"MRS needs top_p >= 1 and alpha in (0, 1], got top_p={top_p}, alpha={alpha}")
        super().__init__()
        self.top_p = top_p
        self.alpha = alpha
        self._score: dict[int, list[float]] = {}  # layer -> S per expert

    def observe_scores(self, layer: int, scores: Sequence[float]) -> None:
        old = self._score.get(layer, [0.0] * len(scores))
        top = set(heapq.nlargest(self.top_p, range(len(scores)), key=scores.__getitem__))
        self._score[layer] = [
            (self.alpha * s if e in top else 0.0) + (1 - self.alpha) * prev
            for e, (s, prev) in enumerate(zip(scores, old))
        ]

    def score(self, key: Key) -> float:
        layer_scores = self._score.get(key[0])
        return layer_scores[key[1]] if layer_scores is not None else 0.0

    def _rank(self, key: Key) -> tuple:
        return (self.score(key), self._stamp.get(key, 0))


class NextUsePolicy(_RankedPolicy):
    """Evicts the expert estimated to be needed again last (Belady's rule, estimated online).

    Estimate for (layer l, expert e) while layer m runs: the layer runs until l runs again,
    (l - m) mod L, or L for l = m, plus L for every whole forward since e was last used there,
    the reuse distance LRU also bets on. A forward's experts all count as just used, so among
    them the layer that ran longest ago is kept and the one that just ran goes first; an expert
    idle for forwards goes before both. Ties -> LRU.
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"next-use needs num_layers >= 1, got {num_layers}")
        super().__init__()
        self.num_layers = num_layers
        self._layer = -1  # the layer running now; before any run, layer 0 comes next
        self._runs = 0  # layer runs begun
        self._last_run: dict[Key, int] = {}  # the run in which each key was last used or admitted

    def begin_run(self, layer: int) -> None:
        if layer != self._layer:  # further waves of the same run are not a new run
            self._runs += 1
            self._layer = layer

    def admit(self, key: Key) -> None:
        self._last_run[key] = self._runs
        super().admit(key)

    def touch(self, key: Key) -> None:
        self._last_run[key] = self._runs
        super().touch(key)

    def evicted(self, key: Key) -> None:
        self._last_run.pop(key, None)
        super().evicted(key)

    def runs_until_needed(self, key: Key) -> int:
        layers = self.num_layers
        until_layer = (key[0] - self._layer - 1) % layers + 1  # 1 for the next layer, L for this one
        idle_forwards = (self._runs - self._last_run.get(key, self._runs)) // layers
        return until_layer + layers * idle_forwards

    def _rank(self, key: Key) -> tuple:
        return (-self.runs_until_needed(key), self._stamp.get(key, 0))


def make_policy(name: str, top_k: int, num_layers: int) -> EvictionPolicy:
    """Policy by name; `top_k` (experts per token) sets MRS's p = 2 * top_k; `num_layers` (MoE
    layers a forward runs) is next-use's cycle."""
    if name == "next-use":
        return NextUsePolicy(num_layers)
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "mrs":
        return MRSPolicy(top_p=2 * top_k)
    raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
