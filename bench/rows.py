"""Timed bs=1 greedy decode rows shared by the benchmark scripts.

Every row decodes the same prompts for the same number of tokens after an untimed warm-up,
and reports the median and p90 time per output token (TPOT) plus, for our engine, the expert
cache figures that explain the time.
"""
from __future__ import annotations

import statistics
import time
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


def guarded(rows: list, name: str, run) -> None:
    """Run one row; a failing row is recorded with its error instead of ending the whole call."""
    import traceback

    try:
        rows.append(run())
    except Exception as exc:  # a benchmark call is expensive: keep the other rows
        traceback.print_exc()
        rows.append(RowResult(name, float("nan"), float("nan"), float("nan"), 0, {"error": repr(exc)}))
    print(rows[-1], flush=True)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_hf_decode(name: str, model, prompts: list[list[int]], new_tokens: int, device: torch.device) -> RowResult:
    """Greedy decode with a transformers model and its own KV cache, one token per forward."""
    from transformers import DynamicCache

    tpots, ttfts = [], []
    for i, prompt in enumerate([prompts[0]] + prompts):  # the first run is warm-up
        ids = torch.tensor([prompt], device=device)
        cache = DynamicCache()
        with torch.no_grad():
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
            end = time.perf_counter()
        if i > 0:
            ttfts.append(first - start)
            tpots.append((end - first) / (new_tokens - 1))
    return RowResult(name, statistics.median(tpots), _quantile(tpots, 0.9), statistics.median(ttfts),
                     new_tokens * len(prompts))


def time_engine_decode(name: str, config, prompts: list[list[int]], new_tokens: int) -> RowResult:
    """Greedy decode through our EngineCore; stats come from the engine's own counters."""
    from engine.core import EngineCore, run_to_completion
    from engine.messages import GenerateRequest, SamplingParams

    core = EngineCore(config)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    tpots, ttfts, stats = [], [], []
    try:
        for i, prompt in enumerate([prompts[0]] + prompts):
            core.runtime.reset_stats()
            done = run_to_completion(core, GenerateRequest(f"bench-{i}", tuple(prompt), params))
            s = core.runtime.generation_stats(ttft_seconds=done.ttft_seconds, tpot_seconds=done.tpot_seconds)
            if i > 0:
                tpots.append(s["tpot_seconds"])
                ttfts.append(s["ttft_seconds"])
                stats.append(s)
    finally:
        core.close()
    decode_tokens = new_tokens - 1
    extra = {
        "hit_rate": statistics.mean(s["hit_rate"] for s in stats),
        "pcie_gb_per_token": statistics.mean(s["pcie_bytes"] for s in stats) / 1e9 / new_tokens,
        "pcie_wait_s_per_token": statistics.mean(s["pcie_wait_seconds"] for s in stats) / new_tokens,
        "decode_tokens_per_prompt": decode_tokens,
    }
    for key in ("acceptance_rate", "mean_accepted_length", "prediction_accuracy"):
        if key in stats[0]:
            extra[key] = statistics.mean(s[key] for s in stats)
    return RowResult(name, statistics.median(tpots), _quantile(tpots, 0.9), statistics.median(ttfts),
                     new_tokens * len(prompts), extra)


def seeded_prompts(vocab_size: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (length,), generator=generator).tolist() for _ in range(count)]
