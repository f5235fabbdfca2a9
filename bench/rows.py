"""Timed bs=1 greedy decode rows shared by the benchmark scripts.

Every row decodes the same prompts for the same number of tokens after an untimed warm-up,
and reports the median and p90 over prompts of the time per output token (TPOT, vLLM's
definition: (last token - first token) / decoded tokens) and of the time to the first token.
For our engine the counters (hit rate, PCIe bytes and wait, acceptance) cover the decode
alone: they are reset once the first token is out, so the prefill's copies do not count.

A row can carry a wall-clock deadline: it then times as many prompts as fit and says how many.
"""
from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class RowResult:
    name: str
    tpot_median_s: float
    tpot_p90_s: float
    ttft_median_s: float
    tokens: int
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def failed_row(name: str, reason: dict) -> RowResult:
    """A row that has no timing; reason is {'error': ...} or {'skipped': ...}."""
    return RowResult(name, float("nan"), float("nan"), float("nan"), 0, dict(reason))


def guarded(rows: list, name: str, run: Callable[[], RowResult]) -> None:
    """Run one row; a failing row is recorded with its error instead of ending the whole call."""
    try:
        rows.append(run())
    except Exception as exc:  # a benchmark call is expensive: keep the other rows
        traceback.print_exc()
        rows.append(failed_row(name, {"error": repr(exc)}))
    print(rows[-1], flush=True)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def _check_started_in_time(deadline: float | None) -> None:
    """After the warm-up: a row with no timed prompt is an error, not a number."""
    if _past(deadline):
        raise TimeoutError("the call's deadline passed before the first timed prompt")


def summary(name: str, tpots: list[float], ttfts: list[float], tokens: int, extra: dict) -> RowResult:
    """A timed row: median and p90 TPOT, median TTFT over the prompts."""
    extra = {"prompts_timed": len(tpots), **extra}
    return RowResult(name, statistics.median(tpots), _quantile(tpots, 0.9), statistics.median(ttfts), tokens, extra)


@torch.no_grad()
def _hf_generate(model, prompt: list[int], new_tokens: int, device: torch.device) -> tuple[float, float]:
    """(TTFT, TPOT) of one greedy generation with the model's own DynamicCache."""
    from transformers import DynamicCache

    ids = torch.tensor([prompt], device=device)
    cache = DynamicCache()
    _sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    token = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    first = time.perf_counter()
    for _ in range(new_tokens - 1):
        out = model(input_ids=token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
    _sync(device)
    return first - start, (time.perf_counter() - first) / (new_tokens - 1)


def time_hf_decode(name: str, model, prompts: list[list[int]], new_tokens: int, device: torch.device, *,
                   warmup_tokens: int | None = None, deadline: float | None = None) -> RowResult:
    """Greedy decode with a transformers model, one token per forward."""
    _hf_generate(model, prompts[0], warmup_tokens or new_tokens, device)
    _check_started_in_time(deadline)
    tpots, ttfts = [], []
    for prompt in prompts:
        ttft, tpot = _hf_generate(model, prompt, new_tokens, device)
        ttfts.append(ttft)
        tpots.append(tpot)
        if _past(deadline):
            break
    return summary(name, tpots, ttfts, new_tokens * len(tpots), {"decode_tokens_per_prompt": new_tokens - 1})


@dataclass(frozen=True)
class Generation:
    """One greedy request through EngineCore, timed."""

    ttft_s: float
    tpot_s: float
    decoded: int  # tokens after the first
    stats: dict  # the engine's counters over the decode window
    tokens: tuple[int, ...]


def engine_generate(core, request_id: str, prompt: list[int], new_tokens: int) -> Generation:
    from moe_serve.engine.messages import GenerateRequest, SamplingParams

    core.add_request(GenerateRequest(request_id, tuple(prompt), SamplingParams(max_tokens=new_tokens, temperature=0.0)))
    ttft = first_at = None
    tokens: list[int] = []
    after_first = 0
    while core.has_unfinished():
        for out in core.step():
            if out.error:
                raise RuntimeError(out.error)
            tokens += out.new_token_ids
            if first_at is None and out.new_token_ids:
                first_at, ttft, after_first = time.perf_counter(), out.first_token_seconds, len(tokens)
                core.runtime.reset_stats()  # the window is the decode alone
    decoded = len(tokens) - after_first
    tpot = (time.perf_counter() - first_at) / decoded
    stats = core.runtime.generation_stats(ttft_seconds=ttft, tpot_seconds=tpot)
    return Generation(ttft, tpot, decoded, stats, tuple(tokens))


def engine_extra(stats: list[dict], decoded: int) -> dict:
    """Decode-window counters summed over the timed prompts, per decoded token."""
    hits = sum(s["expert_hits"] for s in stats)
    accesses = hits + sum(s["expert_misses"] for s in stats)
    extra = {
        "hit_rate": hits / accesses if accesses else 0.0,
        "pcie_gb_per_token": sum(s["pcie_bytes"] for s in stats) / 1e9 / decoded,
        "pcie_wait_s_per_token": sum(s["pcie_wait_seconds"] for s in stats) / decoded,
        "prefetch_used": sum(s["prefetch_used"] for s in stats),
        "prefetch_wasted": sum(s["prefetch_wasted"] for s in stats),
        "decoded_tokens": decoded,
    }
    # wall time of the speculative phases, per decoded token
    for key, name in (("draft_seconds", "draft_s_per_token"), ("verify_seconds", "verify_s_per_token")):
        if any(key in s for s in stats):
            extra[name] = sum(s.get(key, 0.0) for s in stats) / decoded
    for key in ("acceptance_rate", "mean_accepted_length", "prediction_accuracy"):
        values = [s[key] for s in stats if s.get(key) is not None]
        if values:
            extra[key] = statistics.mean(values)
    return extra


def time_engine_decode(name: str, config, prompts: list[list[int]], new_tokens: int, *,
                       warmup_tokens: int | None = None, deadline: float | None = None) -> RowResult:
    """Greedy decode through our EngineCore; stats come from the engine's own counters."""
    from moe_serve.engine.core import EngineCore

    started = time.perf_counter()
    core = EngineCore(config)
    build_seconds = time.perf_counter() - started
    tpots, ttfts, stats, decoded = [], [], [], 0
    try:
        engine_generate(core, "warm-up", prompts[0], warmup_tokens or new_tokens)
        _check_started_in_time(deadline)
        # rows have varied run to run at the same hit rate: was anything else running on the host?
        load = os.getloadavg()[0]
        for i, prompt in enumerate(prompts):
            run = engine_generate(core, f"bench-{i}", prompt, new_tokens)
            ttfts.append(run.ttft_s)
            tpots.append(run.tpot_s)
            stats.append(run.stats)
            decoded += run.decoded
            if _past(deadline):
                break
        settings = core.runtime.describe()
    finally:
        core.close()
    extra = {**engine_extra(stats, decoded), "load_average_1m": load, "engine_build_seconds": build_seconds,
             "settings": settings}
    return summary(name, tpots, ttfts, new_tokens * len(tpots), extra)


def seeded_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]
