"""Missed experts computed on the CPU instead of copied to the GPU (Fiddler, HybriMoE).

A missed expert must cross PCIe before the GPU can run it. The CPU already holds its weights
(the pinned ExpertStore), so for a few tokens it can be cheaper to send the tokens' activations
down, run the expert on the CPU and send the result back. Per layer run the runner asks
`CpuExperts.start` with the missed experts' token loads; the HybriMoE rule decides from costs
profiled at start-up, a CPU thread computes the chosen experts while the GPU copies and computes
the others, and `finish` adds the CPU's sum into the GPU's output. Same experts, same weights,
same math; only the order in which a token's expert outputs are summed changes.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from moe_serve.engine.experts.cache import ExpertSource
from moe_serve.engine.experts.compute import accumulate_experts
from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.timing import median_seconds

CPU_EXPERT_MODES = ("off", "auto")


@dataclass(frozen=True)
class ExpertCosts:
    """Seconds to copy one expert host->device, and to run one on the CPU for n tokens
    (activations down, compute, result up): base + per_token * n."""

    copy_seconds: float
    cpu_base_seconds: float
    cpu_per_token_seconds: float

    def cpu_seconds(self, tokens: int) -> float:
        return self.cpu_base_seconds + self.cpu_per_token_seconds * tokens


def choose_cpu_experts(loads: Mapping[int, int], costs: ExpertCosts) -> list[int]:
    """Which missed experts (expert -> tokens routed to it) to run on the CPU.

    The layer is done when both queues are: the copies (one expert after another over PCIe) and
    the CPU's experts (one after another). HybriMoE's rule: the CPU takes the least-loaded misses
    first, each only while moving it off the copy queue shortens the longer of the two.
    """
    cpu, copies, chosen = 0.0, len(loads), []
    for expert in sorted(loads, key=lambda e: (loads[e], e)):
        after = cpu + costs.cpu_seconds(loads[expert])
        if max(after, (copies - 1) * costs.copy_seconds) >= max(cpu, copies * costs.copy_seconds):
            break
        chosen.append(expert)
        cpu, copies = after, copies - 1
    return chosen


@dataclass(frozen=True)
class CpuJob:
    experts: list[int]
    result: Future  # of the CPU experts' weighted sum [T, H] on the host


class CpuExperts:
    def __init__(self, store: ExpertSource, costs: ExpertCosts) -> None:
        self.costs = costs
        self._store = store
        # one thread: the experts of a layer queue behind each other, as the cost model assumes;
        # each one still uses torch's intra-op threads
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cpu-experts")

    def start(self, x: torch.Tensor, routing: LayerRouting, ids: list[list[int]],
              loads: Mapping[int, int]) -> CpuJob | None:
        """Start the CPU on the misses worth it. Call after the layer's host sync: `ids` [T][k] is
        its routing read back, `loads` maps each missed expert to its token count."""
        chosen = choose_cpu_experts(loads, self.costs)
        if not chosen:
            return None
        # the sync drained the stream, so these small copies wait for nothing; only layers that
        # use the CPU pay for them
        inputs = (x.cpu(), torch.tensor(ids), routing.expert_weights.cpu())  # [T, H], [T, k], [T, k]
        rows = {e: self._store.row(routing.layer, e) for e in chosen}
        return CpuJob(chosen, self._pool.submit(_weighted_sum, inputs, rows, self._store.layouts[routing.layer]))

    def finish(self, job: CpuJob, out: torch.Tensor) -> torch.Tensor:
        """out [T, H] (the GPU experts' sum) plus the CPU experts' sum."""
        return out.add_(job.result.result().to(out.device, non_blocking=True))

    def close(self) -> None:
        self._pool.shutdown()


def _weighted_sum(inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor], rows: dict[int, torch.Tensor],
                  layout: ExpertLayout) -> torch.Tensor:
    x, expert_ids, expert_weights = inputs
    out = torch.zeros_like(x)  # [T, H]
    accumulate_experts(out, x, expert_ids, expert_weights, rows, layout)
    return out


def profile_costs(store: ExpertSource, device: torch.device, repeats: int = 5) -> ExpertCosts:
    """Measure ExpertCosts on this machine with the store's own rows and the runner's own paths."""
    scratch = torch.empty(store.layouts[0].numel, dtype=store.row_dtype, device=device)  # layer 0's expert, as profiled below
    copy = median_seconds(lambda: scratch.copy_(store.row(0, 0), non_blocking=True), device, repeats)
    always = CpuExperts(store, ExpertCosts(copy_seconds=float("inf"), cpu_base_seconds=0.0, cpu_per_token_seconds=0.0))
    try:
        one, many = (median_seconds(_cpu_round_trip(always, store, tokens, device), device, repeats)
                     for tokens in (1, 16))
    finally:
        always.close()
    per_token = max(0.0, (many - one) / 15)
    return ExpertCosts(copy_seconds=copy, cpu_base_seconds=one - per_token, cpu_per_token_seconds=per_token)


def _cpu_round_trip(cpu: CpuExperts, store: ExpertSource, tokens: int, device: torch.device) -> Callable[[], None]:
    """Expert 0 of layer 0 for `tokens` tokens through start -> finish, as a layer run does it."""
    layout = store.layouts[0]
    x = torch.randn(tokens, layout.hidden_size, device=device).to(layout.dtype)  # [T, H]
    probs = torch.full((tokens, store.num_experts), 1.0 / store.num_experts, device=device)  # [T, E]
    routing = LayerRouting(0, torch.zeros(tokens, 1, dtype=torch.long, device=device), probs[:, :1], probs)

    def run() -> None:
        cpu.finish(cpu.start(x, routing, [[0]] * tokens, {0: tokens}), torch.zeros_like(x))

    return run
