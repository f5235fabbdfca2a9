"""ExpertCache: a fixed number of expert slots in one device allocation, filled from the ExpertStore.

Hazards on CUDA and how each is ordered without a global synchronize:
  * read-after-write: every copy records its own event; compute waits on that event on its own
    stream (`current_stream().wait_event`) right before reading the expert slot;
  * write-after-read: when compute releases an expert slot it records a marker on the compute
    stream; the next copy into that expert slot makes its copy stream wait on the marker first;
  * write-after-write: an expert slot whose copy is in flight is never chosen as a victim.
On CPU copies are plain synchronous copies and a HostReady plays the CUDA event's part.
Only the compute thread calls the cache (prefetches included), so it holds no lock.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.policies import EvictionPolicy, Key
from moe_serve.engine.experts.expert_slots import ExpertSlotTable
from moe_serve.engine.experts.stats import ExpertStats

CopyFn = Callable[[torch.Tensor, torch.Tensor], None]  # (dst expert-slot row, src host row)


def copy_row(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src, non_blocking=True)


class ExpertSource(Protocol):
    """What the cache needs from ExpertStore."""

    layouts: tuple[ExpertLayout, ...]  # per layer
    num_layers: int
    num_experts: int
    row_numel: int  # an expert slot's elements
    row_dtype: torch.dtype
    row_nbytes: int

    def row(self, layer: int, expert: int) -> torch.Tensor: ...


class Ready(Protocol):
    """torch.cuda.Event, or HostReady on CPU."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


def cache_capacity(budget: int | float | None, total_experts: int, expert_bytes: int, top_k: int) -> int:
    """Expert slots for a budget in bytes (int) or as a fraction of all expert bytes (float); None = all."""
    if budget is None:
        expert_slots = total_experts
    elif isinstance(budget, float):
        expert_slots = int(budget * total_experts)
    else:
        expert_slots = budget // expert_bytes
    if expert_slots < top_k:
        need = top_k * expert_bytes
        shown = f"{budget:.4g} of all expert bytes" if isinstance(budget, float) else f"{budget} bytes"
        raise ValueError(
            f"GPU expert budget {shown} holds {expert_slots} experts of {expert_bytes} bytes, but one token "
            f"needs top_k={top_k} experts in a layer: the minimum budget is {need} bytes "
            f"({need / 2**30:.3f} GiB)"
        )
    return min(expert_slots, total_experts)


class HostReady:
    """CPU stand-in for a CUDA event: set by the thread that finished (or failed) the copy."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError("expert copy failed") from self.error


def _nothing() -> None:
    pass


class _HostCopier:
    """CPU device: the thread that runs `work` copies synchronously, then sets each HostReady."""

    def __init__(self, copy_fn: CopyFn) -> None:
        self._copy_fn = copy_fn
        self._waits: list[tuple[int, float]] = []  # (layer, seconds), compute thread only

    def start(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Sequence[object],
              *, demand_layer: int | None) -> tuple[list[HostReady], Callable[[], None]]:
        readies = [HostReady() for _ in pairs]

        def work() -> None:
            started = time.perf_counter()
            try:
                for (dst, src), ready in zip(pairs, readies):
                    self._copy_fn(dst, src)
                    ready.set()
            except BaseException as exc:
                for ready in readies:
                    if not ready.query():
                        ready.set(exc)
                raise
            if demand_layer is not None:  # compute itself did the copy: all of it is waiting
                self._waits.append((demand_layer, time.perf_counter() - started))

        return readies, work

    def compute_wait(self, layer: int, readies: Sequence[HostReady]) -> None:
        started = time.perf_counter()
        for ready in readies:
            ready.synchronize()
        self._waits.append((layer, time.perf_counter() - started))

    def failed(self, ready: HostReady) -> bool:
        return ready.error is not None

    def release_marker(self) -> None:
        return None  # CPU compute is synchronous: a released expert slot is no longer being read

    def drain_waits(self) -> list[tuple[int, float]]:
        waits, self._waits = self._waits, []
        return waits


class _CudaCopier:
    """Demand and prefetch copies on two dedicated streams, one event per copied expert."""

    def __init__(self, device: torch.device, copy_fn: CopyFn) -> None:
        self._copy_fn = copy_fn
        self._demand = torch.cuda.Stream(device)
        self._prefetch = torch.cuda.Stream(device)
        self._waits: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []  # compute thread only

    def start(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]], after: Sequence[torch.cuda.Event],
              *, demand_layer: int | None) -> tuple[list[torch.cuda.Event], Callable[[], None]]:
        stream = self._demand if demand_layer is not None else self._prefetch
        readies = []
        with torch.cuda.stream(stream):
            for marker in after:
                stream.wait_event(marker)
            for dst, src in pairs:
                self._copy_fn(dst, src)
                ready = torch.cuda.Event()
                ready.record(stream)
                readies.append(ready)
        return readies, _nothing

    def compute_wait(self, layer: int, readies: Sequence[torch.cuda.Event]) -> None:
        # One event pair brackets the whole stall on the compute stream; read lazily in drain_waits.
        stream = torch.cuda.current_stream()
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        for ready in readies:
            stream.wait_event(ready)
        end.record(stream)
        self._waits.append((layer, begin, end))

    def failed(self, ready: torch.cuda.Event) -> bool:
        return False  # a failed launch raises in start()

    def release_marker(self) -> torch.cuda.Event:
        marker = torch.cuda.Event()
        marker.record(torch.cuda.current_stream())
        return marker

    def drain_waits(self) -> list[tuple[int, float]]:
        waits, self._waits = self._waits, []
        for _, _, end in waits:
            end.synchronize()  # already complete after the step's own sync: costs nothing
        return [(layer, begin.elapsed_time(end) / 1e3) for layer, begin, end in waits]


@dataclass(frozen=True)
class Wave:
    """Experts of one layer that fit in the cache together, pinned until `release`."""

    layer: int
    keys: list[Key]
    expert_slots: dict[int, int]  # expert -> expert slot index, for compute that gathers by expert slot
    pending: dict[int, Ready]  # experts whose copy compute must wait for first -> that copy
    leftover: list[int]  # experts that found no expert slot: the next wave
    allocation: torch.Tensor  # the cache's expert slots [S, numel]

    def slots(self, *, landed: bool) -> dict[int, int]:
        """expert -> expert slot of the experts readable at once (landed) or only after `wait_pending`."""
        return {e: s for e, s in self.expert_slots.items() if (e not in self.pending) == landed}

    def rows(self, *, landed: bool) -> dict[int, torch.Tensor]:
        """slots(landed) as expert -> expert-slot row [numel]. Views are made here, not per acquire:
        compute that reads the expert slots in place never needs them."""
        return {e: self.allocation[s] for e, s in self.slots(landed=landed).items()}


class ExpertCache:
    def __init__(self, store: ExpertSource, budget: int | float | None, policy: EvictionPolicy,
                 device: torch.device | str, top_k: int, copy_fn: CopyFn = copy_row) -> None:
        self.device = torch.device(device)
        total = store.num_layers * store.num_experts
        self.capacity = cache_capacity(budget, total, store.row_nbytes, top_k)
        self.stats = ExpertStats(store.num_layers, [layout.nbytes for layout in store.layouts])
        self._store = store
        self._expert_slots = torch.empty(self.capacity, store.row_numel, dtype=store.row_dtype,
                                         device=self.device)  # [S, numel]: rows in the store's format
        self._table = ExpertSlotTable(self.capacity, policy)
        cuda = self.device.type == "cuda"
        self._copier = _CudaCopier(self.device, copy_fn) if cuda else _HostCopier(copy_fn)
        self._ready: dict[Key, Ready] = {}  # copy handle of each in-flight key
        self._released: dict[int, torch.cuda.Event] = {}  # expert slot -> marker after its last read
        # every expert resident: a device-side (layer, expert) -> expert slot map lets compute skip the host
        self.resident_expert_slots: torch.Tensor | None = None  # [L, E] int64 on device
        if self.capacity == total:
            self._preload(store.num_layers, store.num_experts)
            self.resident_expert_slots = torch.tensor(
                [[self._table.expert_slot_of((l, e)) for e in range(store.num_experts)]
                 for l in range(store.num_layers)],
                dtype=torch.long, device=self.device)

    @property
    def expert_slots(self) -> torch.Tensor:
        """The expert slots, one allocation [S, numel] (compute reads rows of it)."""
        return self._expert_slots

    @property
    def resident_experts(self) -> int:
        return len(self._table)

    def begin_run(self, layer: int) -> None:
        """A run of `layer` begins (once, before its waves): the policy's clock."""
        self._table.policy.begin_run(layer)

    def observe_scores(self, layer: int, scores: Sequence[float]) -> None:
        self._table.policy.observe_scores(layer, scores)

    def acquire(self, layer: int, experts: Sequence[int], *, whole: bool = False) -> Wave:
        """Pin the resident experts, start demand copies for as many missing ones as fit.

        `whole`: wait for in-flight copies until every expert fits in this one wave (a replayed
        CUDA graph computes all of a layer's experts at once and cannot run a second wave)."""
        keys = [(layer, e) for e in experts]
        while True:
            self._refresh_in_flight()
            fits = not whole or self._table.can_hold(keys)
            plan = self._table.plan_wave(keys) if fits else None
            if plan is not None and (plan.hits or plan.misses.placed or not keys):
                work = self._start_copies(plan.misses.placed, demand_layer=layer)
                self.stats.add_wave(layer, plan)
                wave = self._wave(layer, plan.hits, plan.misses.placed, plan.misses.unplaced)
                break
            blocker = self._oldest_in_flight()
            try:
                blocker.synchronize()  # every unpinned expert slot is still being filled: let one land
            except RuntimeError:
                pass  # that prefetch failed (raised where it started): the refresh drops it
        try:
            work()
        except BaseException:
            self.release(wave)
            raise
        return wave

    @property
    def kept(self) -> int:
        """Experts a streamed span keeps (ExpertSlotTable.keep), resident or being copied."""
        return self._table.kept

    def keep(self, layer: int, experts: Sequence[int]) -> None:
        """Keep `layer`'s `experts` resident, in place of the ones it kept: they are never evicted
        until `keep_nothing` (a streamed span's residents, streaming.py)."""
        self._table.keep(layer, [(layer, e) for e in experts])

    def keep_nothing(self) -> None:
        self._table.keep_nothing()

    def is_kept(self, layer: int, expert: int) -> bool:
        return self._table.is_kept((layer, expert))

    def missing(self, layer: int, experts: Sequence[int]) -> list[int]:
        """The `experts` of `layer` that are not resident (nor being copied) right now."""
        return [e for e in experts if (layer, e) not in self._table]

    def wait_pending(self, wave: Wave) -> None:
        """Make compute wait until every copy of the wave has landed (GPU-side waits on CUDA)."""
        if not wave.pending:
            return
        self._copier.compute_wait(wave.layer, list(wave.pending.values()))
        for expert, ready in wave.pending.items():
            if self._ready.get((wave.layer, expert)) is ready:
                del self._ready[(wave.layer, expert)]
                self._table.complete((wave.layer, expert))

    def release(self, wave: Wave) -> None:
        marker = self._copier.release_marker()
        for key in wave.keys:
            self._table.unpin(key)
            if marker is not None:
                self._released[self._table.expert_slot_of(key)] = marker

    def prefetch(self, keys: Sequence[Key], *, within_room: bool = False) -> None:
        """Start copying the non-resident (layer, expert) `keys` ahead of need, in order, on the
        prefetch stream; the resident ones are kept for that need (ExpertSlotTable.expect). One call
        for many layers costs one placement: per call the host work was ~40-90 us.

        `within_room`: only as many as ExpertSlotTable.room allows now; the others are neither copied
        nor counted as dropped (a streamed layer's tail asks again as each of its waves frees expert
        slots)."""
        self._table.expect(keys)
        wanted = [key for key in keys if key not in self._table]
        if not wanted:  # all resident or in flight: the common case while drafting, kept cheap
            return
        if within_room or self._table.free_expert_slots < len(wanted):
            self._refresh_in_flight()  # landed copies become evictable (an event query each)
        if within_room:
            wanted = wanted[: self._table.room()]
            if not wanted:
                return
        placement = self._table.place(wanted, pin=False, prefetched=True)
        work = self._start_copies(placement.placed, demand_layer=None)
        self.stats.add_prefetch(placement)
        work()

    def finish_step(self) -> None:
        """Resolve this step's PCIe-wait timings; call after the step's natural sync."""
        for layer, seconds in self._copier.drain_waits():
            self.stats.add(layer, pcie_wait_seconds=seconds)

    def _wave(self, layer: int, hits: list[Key], placed: list[tuple[Key, int]], unplaced: list[Key]) -> Wave:
        keys = hits + [k for k, _ in placed]
        return Wave(layer=layer, keys=keys, expert_slots={key[1]: self._table.expert_slot_of(key) for key in keys},
                    pending={key[1]: self._ready[key] for key in keys if self._table.is_in_flight(key)},
                    leftover=[k[1] for k in unplaced], allocation=self._expert_slots)

    def _start_copies(self, placed: list[tuple[Key, int]], *, demand_layer: int | None) -> Callable[[], None]:
        rows = [(self._store.row(*key), expert_slot) for key, expert_slot in placed]
        pairs = [(self._expert_slots[expert_slot, :len(row)], row) for row, expert_slot in rows]  # no padding moves
        markers = {id(m): m for m in (self._released.get(expert_slot) for _, expert_slot in placed) if m is not None}
        try:
            readies, work = self._copier.start(pairs, list(markers.values()), demand_layer=demand_layer)
        except BaseException:
            for key, _ in placed:
                self._table.drop(key)
            raise
        for (key, _), ready in zip(placed, readies):
            self._ready[key] = ready
        return work

    def _refresh_in_flight(self) -> None:
        for key in self._table.in_flight():
            ready = self._ready[key]
            if ready.query():
                del self._ready[key]
                if self._copier.failed(ready):
                    self._table.drop(key)
                else:
                    self._table.complete(key)

    def _oldest_in_flight(self) -> Ready:
        if not self._ready:
            raise RuntimeError(f"no expert slot can be freed: all {self.capacity} expert slots are pinned")
        return next(iter(self._ready.values()))

    def _preload(self, num_layers: int, num_experts: int) -> None:
        """The budget holds every expert: fill the cache once at start-up, no misses later."""
        keys = [(layer, e) for layer in range(num_layers) for e in range(num_experts)]
        placement = self._table.place(keys, pin=False, prefetched=False)
        work = self._start_copies(placement.placed, demand_layer=None)
        work()
        for ready in self._ready.values():
            ready.synchronize()
        self._refresh_in_flight()
