"""ExpertSlotTable: which expert sits in which expert slot of the cache, which expert slots are
pinned or still being filled.

Plain Python, no torch, not thread-safe (ExpertCache holds a lock around it). The replay tool
drives the very same table with a recorded trace.

An expert slot is evictable only when it is resident, unpinned (no compute is about to read
it) and not in flight (its copy may still be writing). When nothing is evictable the table says
so by placing fewer keys than asked; it never waits.

A prefetch never evicts an open prediction: an expert predicted for a coming run of its layer
(prefetched, or resident already when predicted: `expect`), not used since, whose layer has not
run since. Both are guesses of what a coming layer run needs, and the open one was made first,
for a layer that runs sooner (SP-MoE's draft phase predicts every drafted token's experts,
layer by layer, for one verify pass); a prefetch that evicted a resident prediction would only
trade one copy the verify pass needs for another. Demand copies take open predictions only when
nothing else can go (a need is certain, a guess is not; policies that rank by use history would
otherwise evict a fresh guess first), and once its layer has run without it, it was a wrong
guess and any copy may.

A streamed span (streaming.py) may keep experts: kept keys are never victims, so they stay
resident from one streamed run of their layer to the next while the other expert slots stream.
Keeping ends when the runner says so (`keep_nothing`), before any run that needs the whole table
again.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from moe_serve.engine.experts.policies import EvictionPolicy, Key


@dataclass(frozen=True)
class Eviction:
    key: Key
    expert_slot: int
    wasted_prefetch: bool  # prefetched, then evicted before any compute used it


@dataclass(frozen=True)
class Placement:
    """Keys given an expert slot (now in flight: the caller copies into it, then calls complete)."""

    placed: list[tuple[Key, int]]  # (key, its expert slot)
    evictions: list[Eviction]
    unplaced: list[Key]  # no expert slot could be freed for these


@dataclass(frozen=True)
class WavePlan:
    """One wave of a layer's demand: hits pinned, misses placed and pinned, the rest deferred."""

    hits: list[Key]
    hits_in_flight: list[Key]  # subset of hits whose copy (a prefetch) may still be writing
    prefetch_used: int  # hits that a prefetch brought in and no compute had used yet
    misses: Placement


class ExpertSlotTable:
    def __init__(self, capacity: int, policy: EvictionPolicy) -> None:
        if capacity < 1:
            raise ValueError(f"an expert slot table needs at least one expert slot, got capacity={capacity}")
        self.capacity = capacity
        self.policy = policy
        self._free = list(range(capacity - 1, -1, -1))  # pop() hands out expert slot 0 first
        self._expert_slot: dict[Key, int] = {}
        self._pins: dict[Key, int] = {}
        self._in_flight: set[Key] = set()
        self._unused_prefetch: set[Key] = set()
        self._open_predictions: set[Key] = set()  # predicted, unused, its layer has not run since
        self._evictable: set[Key] = set()  # resident, unpinned, landed: kept up to date, not recomputed
        self._kept: set[Key] = set()  # never victims: a streamed span's residents (resident or not yet)

    def __len__(self) -> int:
        return len(self._expert_slot)

    def __contains__(self, key: Key) -> bool:
        return key in self._expert_slot

    def expert_slot_of(self, key: Key) -> int:
        return self._expert_slot[key]

    @property
    def free_expert_slots(self) -> int:
        return len(self._free)

    def in_flight(self) -> list[Key]:
        return list(self._in_flight)

    def is_in_flight(self, key: Key) -> bool:
        return key in self._in_flight

    def is_pinned(self, key: Key) -> bool:
        return key in self._pins

    def pin(self, key: Key) -> None:
        if key not in self._expert_slot:
            raise KeyError(f"cannot pin {key}: not resident")
        self._pins[key] = self._pins.get(key, 0) + 1
        self._evictable.discard(key)

    def unpin(self, key: Key) -> None:
        count = self._pins.get(key, 0)
        if count == 0:
            raise KeyError(f"cannot unpin {key}: not pinned")
        if count == 1:
            del self._pins[key]
            self._mark_if_evictable(key)
        else:
            self._pins[key] = count - 1

    def complete(self, key: Key) -> None:
        """The copy into `key`'s expert slot is known to be done (or ordered before every reader)."""
        self._in_flight.discard(key)
        self._mark_if_evictable(key)

    def drop(self, key: Key) -> None:
        """Forget `key` without counting an eviction: its copy failed, its expert slot holds garbage."""
        self._pins.pop(key, None)
        self._in_flight.discard(key)
        self._evict(key)

    def use(self, key: Key) -> bool:
        """Compute is about to read `key`; True when this is the first use of a prefetched expert."""
        self.policy.touch(key)
        self._open_predictions.discard(key)
        if key in self._unused_prefetch:
            self._unused_prefetch.remove(key)
            return True
        return False

    def expect(self, keys: Sequence[Key]) -> None:
        """`keys` are predicted for the next run of their layers: the resident ones become open predictions."""
        self._open_predictions.update(key for key in keys if key in self._expert_slot)

    def evictable(self) -> set[Key]:
        return self._evictable

    @property
    def kept(self) -> int:
        """Keys kept, resident or still to be copied: at most this many expert slots are not streaming."""
        return len(self._kept)

    def is_kept(self, key: Key) -> bool:
        return key in self._kept

    def keep(self, layer: int, keys: Collection[Key]) -> None:
        """`keys` (of `layer`) replace the layer's kept keys; the non-resident ones are protected once placed."""
        self._kept = {k for k in self._kept if k[0] != layer} | set(keys)

    def keep_nothing(self) -> None:
        self._kept.clear()

    def room(self) -> int:
        """Keys a prefetch can place now: free expert slots and the victims it may take (not kept,
        not an open prediction)."""
        return len(self._free) + len(self._victims(prefetched=True))

    def can_hold(self, keys: Sequence[Key]) -> bool:
        """Whether plan_wave(keys) would place every missing key (no leftover) right now."""
        wanted = set(keys)
        missing = sum(key not in self._expert_slot for key in wanted)
        return missing <= len(self._free) + len(self._victims(prefetched=False) - wanted)

    def place(self, keys: Sequence[Key], *, pin: bool, prefetched: bool) -> Placement:
        """Give each non-resident key an expert slot, in order, evicting through the policy as needed."""
        for key in keys:
            if key in self._expert_slot:
                raise ValueError(f"{key} is already resident in expert slot {self._expert_slot[key]}")
        shortfall = len(keys) - len(self._free)
        victims = self.policy.victims(self._victims(prefetched=True), shortfall) if shortfall > 0 else []
        if not prefetched and len(victims) < shortfall:
            victims += self.policy.victims(self._victims(prefetched=False) & self._open_predictions,
                                           shortfall - len(victims))
        evictions = [self._evict(v) for v in victims]
        n = min(len(keys), len(self._free))
        placed = [(key, self._occupy(key, pin=pin, prefetched=prefetched)) for key in keys[:n]]
        return Placement(placed=placed, evictions=evictions, unplaced=list(keys[n:]))

    def plan_wave(self, keys: Sequence[Key]) -> WavePlan:
        """Pin the resident keys (hits) and place as many of the others as the table allows."""
        if keys:  # the layer runs: its open predictions it does not ask for were wrong
            layer, wanted = keys[0][0], set(keys)
            self._open_predictions = {k for k in self._open_predictions if k[0] != layer or k in wanted}
        hits = [k for k in keys if k in self._expert_slot]
        for key in hits:
            self.pin(key)
        prefetch_used = sum(self.use(k) for k in hits)
        misses = self.place([k for k in keys if k not in self._expert_slot], pin=True, prefetched=False)
        for key, _ in misses.placed:
            self.use(key)
        in_flight = [k for k in hits if k in self._in_flight]
        return WavePlan(hits=hits, hits_in_flight=in_flight, prefetch_used=prefetch_used, misses=misses)

    def _victims(self, *, prefetched: bool) -> set[Key]:
        """Evictable keys a placement may take: never kept ones; a prefetch never open predictions."""
        candidates = self._evictable - self._kept if self._kept else self._evictable
        return candidates - self._open_predictions if prefetched else candidates

    def _mark_if_evictable(self, key: Key) -> None:
        if key in self._expert_slot and key not in self._pins and key not in self._in_flight:
            self._evictable.add(key)

    def _occupy(self, key: Key, *, pin: bool, prefetched: bool) -> int:
        expert_slot = self._free.pop()
        self._expert_slot[key] = expert_slot
        self._in_flight.add(key)
        if pin:
            self._pins[key] = 1
        if prefetched:
            self._unused_prefetch.add(key)
            self._open_predictions.add(key)
        self.policy.admit(key)
        return expert_slot

    def _evict(self, key: Key) -> Eviction:
        expert_slot = self._expert_slot.pop(key)
        self._free.append(expert_slot)
        wasted = key in self._unused_prefetch
        self._unused_prefetch.discard(key)
        self._open_predictions.discard(key)
        self._evictable.discard(key)
        self.policy.evicted(key)
        return Eviction(key=key, expert_slot=expert_slot, wasted_prefetch=wasted)
