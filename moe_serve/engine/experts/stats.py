"""Per-layer counters of the expert cache, prefetcher and predictor (plain Python, no torch).

Written by the compute thread, read by the engine's metrics snapshot; the lock keeps a snapshot
whole. The replay tool fills the same counters from a trace.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

from moe_serve.engine.experts.expert_slots import Placement, WavePlan


@dataclass
class LayerStats:
    hits: int = 0  # needed experts found resident (or already being prefetched)
    misses: int = 0  # needed experts not resident: copied on demand, or computed on the CPU
    demand_bytes: int = 0  # host->device bytes copied because compute needed them now
    prefetch_bytes: int = 0  # host->device bytes copied ahead of need
    evictions: int = 0  # experts of this layer pushed out of the cache
    prefetch_used: int = 0  # prefetched experts later used by compute
    prefetch_wasted: int = 0  # prefetched experts evicted before any use
    prefetch_dropped: int = 0  # predicted experts not prefetched: no expert slot could be freed
    waves: int = 0  # compute waves (1 per layer run unless the cache cannot hold its experts)
    predicted_correct: int = 0  # |predicted ∩ used| for the next-layer predictor
    predicted_needed: int = 0  # |used| for the layer runs the predictor had a guess for
    pcie_wait_seconds: float = 0.0  # time compute was blocked on expert copies
    cpu_expert_computations: int = 0  # missed experts run on the CPU instead of copied (--cpu-experts)

    @property
    def accesses(self) -> int:
        return self.hits + self.misses

    @property
    def hit_rate(self) -> float:
        return self.hits / self.accesses if self.accesses else 0.0

    @property
    def predictor_accuracy(self) -> float:
        return self.predicted_correct / self.predicted_needed if self.predicted_needed else 0.0

    def __add__(self, other: LayerStats) -> LayerStats:
        return LayerStats(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


@dataclass(frozen=True)
class StatsSnapshot:
    per_layer: tuple[LayerStats, ...]  # detached copies

    def total(self) -> LayerStats:
        return sum(self.per_layer, LayerStats())

    def column(self, name: str) -> tuple:
        """One counter across layers, e.g. column('hits') for the per-layer Prometheus series."""
        return tuple(getattr(s, name) for s in self.per_layer)


class ExpertStats:
    def __init__(self, num_layers: int, expert_bytes: Sequence[int] | None = None) -> None:
        """expert_bytes: what one copy of an expert moves, per layer (None: 1, counting copies)."""
        self._layers = [LayerStats() for _ in range(num_layers)]
        self._expert_bytes = list(expert_bytes) if expert_bytes is not None else [1] * num_layers
        self._lock = threading.Lock()

    def add(self, layer: int, **deltas: float) -> None:
        with self._lock:
            self._add(layer, deltas)

    def add_every_layer(self, **deltas: float) -> None:
        """The same deltas for every layer under one lock (a CUDA-graph replay of a whole token)."""
        with self._lock:
            for layer in range(len(self._layers)):
                self._add(layer, deltas)

    def add_wave(self, layer: int, plan: WavePlan) -> None:
        misses = len(plan.misses.placed)
        with self._lock:  # once per layer run: one lock, not one per counter
            self._add(layer, {"hits": len(plan.hits), "misses": misses,
                              "demand_bytes": misses * self._expert_bytes[layer],
                              "prefetch_used": plan.prefetch_used, "waves": 1})
            self._add_evictions(plan.misses)

    def add_prefetch(self, placement: Placement) -> None:
        """Booked to each key's own layer: one prefetch may span layers."""
        with self._lock:
            for (layer, _), _expert_slot in placement.placed:
                self._add(layer, {"prefetch_bytes": self._expert_bytes[layer]})
            for layer, _ in placement.unplaced:
                self._add(layer, {"prefetch_dropped": 1})
            self._add_evictions(placement)

    def _add(self, layer: int, deltas: dict[str, float]) -> None:
        counters = self._layers[layer]
        for name, delta in deltas.items():
            setattr(counters, name, getattr(counters, name) + delta)

    def _add_evictions(self, placement: Placement) -> None:
        for ev in placement.evictions:
            self._add(ev.key[0], {"evictions": 1, "prefetch_wasted": int(ev.wasted_prefetch)})

    def clear(self) -> None:
        """Forget what was counted (the start-up captures' forwards are not service)."""
        with self._lock:
            self._layers = [LayerStats() for _ in self._layers]

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(per_layer=tuple(replace(s) for s in self._layers))
