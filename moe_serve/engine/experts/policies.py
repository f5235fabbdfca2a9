"""Eviction policies of the expert cache: which resident expert leaves when an expert slot is needed.

Plain Python, no torch: the live ExpertCache (through ExpertSlotTable) and the offline replay use
the same objects, so a hit rate measured by replay is the hit rate the server would see.

LFU and MRS rank candidates by a tuple whose last element is the last-use stamp, so their ties
fall back to LRU (temporal locality dominates MoE routing, see the EBCO report).

Next-use estimates when each candidate is needed again from the order a forward runs the MoE
layers in (0, 1, ..., L-1, then 0 again), which the others ignore, and how often its layer routes
to it: an expert of the layer after the current one gets its next chance within one layer run;
one of the layer that just ran waits a whole forward. When a forward needs more experts than the
cache holds (a verify pass over many tokens) LRU evicts exactly the experts that come next and
hits ~0%; next-use keeps them (bench/results/routing-replay/routing_replay.md).
"""
from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import Protocol

Key = tuple[int, int]  # (moe layer, expert id)

POLICY_NAMES = ("lru", "lfu", "mrs", "next-use")


class EvictionPolicy(Protocol):
    def begin_run(self, layer: int) -> None:
        """A run of MoE layer `layer` begins (once, before its waves)."""

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


class NextUsePolicy(LRUPolicy):
    """Evicts the expert expected to be needed again last: Belady's rule, with an estimate.

    While layer m runs, an expert of layer l gets its next chance in u = (l - m) mod L layer runs
    (L for l = m) and another every L runs after. If its layer's runs route to it with probability
    p, it is needed after u + L(1 - p)/p runs on average (geometric). p is an exponential average
    over the layer's runs (weight `alpha` for the newest, ~20 runs of memory), kept across
    evictions like LFU's counts and started at top_k / E, the uniform router's rate. Ties -> LRU.

    Choosing victims must not cost a scan of the whole cache per miss (thousands of expert
    slots for 128-expert models): every run of a layer decays all its rates alike, so within a
    layer the order by rate only changes when a key is used. Each layer keeps a heap in that order
    (stale entries skipped, compacted when they pile up); a victim is the layer front with the
    largest estimate.
    """

    def __init__(self, num_layers: int, prior: float, alpha: float = 0.05) -> None:
        if num_layers < 1 or not 0 < prior <= 1 or not 0 < alpha < 1:
            raise ValueError(f"next-use needs num_layers >= 1, prior in (0, 1] and alpha in (0, 1), got "
                             f"{num_layers}, {prior}, {alpha}")
        super().__init__()
        self.num_layers = num_layers
        self.prior = prior
        self.alpha = alpha
        self._log_keep = math.log(1 - alpha)  # a run without the key multiplies its rate by 1 - alpha
        self._layer = -1  # the layer running now; before any run, layer 0 comes next
        self._runs = [0] * num_layers  # runs begun, per layer
        self._rate: dict[Key, tuple[float, int]] = {}  # key -> (p, its layer's run that p includes)
        # per layer: resident key -> its live entry in the layer's heap (order by rate, then stamp)
        self._order: list[dict[Key, tuple[float, int]]] = [{} for _ in range(num_layers)]
        self._heaps: list[list[tuple[float, int, Key]]] = [[] for _ in range(num_layers)]

    def begin_run(self, layer: int) -> None:
        self._runs[layer] += 1
        self._layer = layer

    def admit(self, key: Key) -> None:
        self._rate.setdefault(key, self._history(key))
        super().admit(key)
        self._push(key)

    def touch(self, key: Key) -> None:
        run = self._runs[key[0]]
        p, seen = self._history(key)
        if seen != run:  # a run counts once, however many waves touch the key
            self._rate[key] = (p * (1 - self.alpha) ** (run - seen) + self.alpha, run)
        super().touch(key)
        if key in self._order[key[0]]:
            self._push(key)

    def evicted(self, key: Key) -> None:
        super().evicted(key)
        self._order[key[0]].pop(key, None)

    def rate(self, key: Key) -> float:
        """p: how often the runs of the key's layer route to it, runs without it decayed in."""
        p, seen = self._history(key)
        return p * (1 - self.alpha) ** (self._runs[key[0]] - seen)

    def _history(self, key: Key) -> tuple[float, int]:
        """(p, the run it includes); a key never used had the prior before its layer's current run."""
        return self._rate.get(key, (self.prior, self._runs[key[0]] - 1))

    def runs_until_needed(self, key: Key) -> float:
        until = (key[0] - self._layer - 1) % self.num_layers + 1  # 1 for the next layer, L for this one
        p = self.rate(key)
        return until + self.num_layers * (1 - p) / p if p > 0 else math.inf  # p underflows after ~10^4 idle runs

    def victims(self, candidates: Collection[Key], n: int) -> list[Key]:
        chosen: list[Key] = []
        fronts = []  # (-estimate, stamp, key): each layer's best remaining candidate
        for layer in range(self.num_layers):
            self._add_front(fronts, layer, candidates, chosen)
        heapq.heapify(fronts)
        while fronts and len(chosen) < n:
            key = heapq.heappop(fronts)[2]
            chosen.append(key)
            self._add_front(fronts, key[0], candidates, chosen, push=True)
        return chosen

    def _add_front(self, fronts: list, layer: int, candidates: Collection[Key], chosen: list[Key],
                   push: bool = False) -> None:
        key = self._front(layer, candidates, chosen)
        if key is None:
            return
        entry = (-self.runs_until_needed(key), self._stamp[key], key)
        if push:
            heapq.heappush(fronts, entry)
        else:
            fronts.append(entry)

    def _front(self, layer: int, candidates: Collection[Key], chosen: list[Key]) -> Key | None:
        """The layer's lowest-rate key among the candidates not chosen yet, its heap left intact."""
        heap, live, held, found = self._heaps[layer], self._order[layer], [], None
        while heap:
            order, stamp, key = heap[0]
            if live.get(key) != (order, stamp):
                heapq.heappop(heap)  # stale: used again since, or evicted
            elif key in candidates and key not in chosen:
                found = key
                break
            else:
                held.append(heapq.heappop(heap))  # pinned, in flight or already chosen: keep it
        for entry in held:
            heapq.heappush(heap, entry)
        return found

    def _push(self, key: Key) -> None:
        p, seen = self._rate[key]
        order = (math.log(p) - seen * self._log_keep, self._stamp[key])  # log of p decayed to run 0
        live, heap = self._order[key[0]], self._heaps[key[0]]
        live[key] = order
        heapq.heappush(heap, (*order, key))
        if len(heap) > 2 * len(live) + 16:  # mostly stale entries: rebuild
            heap[:] = [(*o, k) for k, o in live.items()]
            heapq.heapify(heap)


def make_policy(name: str, top_k: int, num_layers: int, num_experts: int) -> EvictionPolicy:
    """Policy by name; `top_k` (experts per token) sets MRS's p = 2 * top_k; next-use cycles
    through `num_layers` MoE layers and starts every expert at top_k / num_experts."""
    if name == "next-use":
        return NextUsePolicy(num_layers, prior=min(1.0, top_k / num_experts))
    if name == "lru":
        return LRUPolicy()
    if name == "lfu":
        return LFUPolicy()
    if name == "mrs":
        return MRSPolicy(top_p=2 * top_k)
    raise ValueError(f"unknown cache policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
