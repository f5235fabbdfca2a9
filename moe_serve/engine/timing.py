"""Wall-clock timing of device work for start-up profiles (cutoff layer, CPU-vs-copy decisions)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so a host clock around a call sees the work, not the launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    """Median wall time of fn() over `repeats` runs after one untimed warm-up (allocator, kernels)."""
    fn()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)
