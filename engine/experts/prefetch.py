"""PrefetchWorker: a thread that copies predicted experts into the cache ahead of need.

SP-MoE Algorithm 2. Producers (speculative decoding's draft-phase predictors, on the compute
thread) push PrefetchTasks; the worker
waits on each task's ready event (on this thread, so compute never blocks), drops experts that
are resident or already in flight, reserves slots through the eviction policy (never pinned or
in-flight ones; without a free slot the rest of the task is dropped and counted) and issues the
layer's copies together on the prefetch stream, one event per expert.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.experts.cache import ExpertCache


@dataclass(frozen=True)
class PrefetchTask:
    layer: int
    experts: torch.Tensor  # [m] int64 on the host, most important first; -1 = no expert
    ready: torch.cuda.Event | None  # recorded after `experts` was written; None on CPU
    due: int  # layer-run index at which `layer` starts; once reached, the task is stale


class PrefetchWorker:
    def __init__(self, cache: ExpertCache, progress: Callable[[], int]) -> None:
        """`progress()` returns how many layer runs have started (to skip stale tasks)."""
        self._cache = cache
        self._progress = progress
        self._queue: queue.SimpleQueue[PrefetchTask | threading.Event | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="expert-prefetch", daemon=True)
        self._thread.start()

    def submit(self, task: PrefetchTask) -> None:
        self.raise_if_failed()
        self._queue.put(task)

    def wait_idle(self) -> None:
        """Block until every task submitted so far has been handled."""
        barrier = threading.Event()
        self._queue.put(barrier)
        while not barrier.wait(0.05) and self._thread.is_alive():
            pass
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("expert prefetch worker failed") from self._error

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        self.raise_if_failed()

    def _loop(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                if isinstance(item, threading.Event):
                    item.set()
                else:
                    self._handle(item)
        except BaseException as exc:  # surfaced on the compute thread by the next submit/close
            self._error = exc

    def _handle(self, task: PrefetchTask) -> None:
        if task.ready is not None:
            task.ready.synchronize()
        if self._progress() >= task.due:
            self._cache.stats.add(task.layer, prefetch_stale=1)
            return
        experts = [e for e in task.experts.tolist() if e >= 0]
        self._cache.prefetch(task.layer, experts)
