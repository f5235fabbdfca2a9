"""CachedExpertRunner: the data path of one MoE layer over the GPU expert cache.

Per layer run the host launches the next-layer guess (when prefetching), then reads the routing,
the MRS scores and the guess back in ONE host sync. Misses that the cost model gives to the CPU
(--cpu-experts) start on a CPU thread; the other experts are pinned (hits) or demand-copied and
computed: one token by one gathered batched matmul after its copies landed, more tokens grouped
by expert while the copies fly. Then the guess is prefetched and the CPU's sum added. If the
layer needs more experts than the cache can hold at once (a long verify pass, a tiny budget) it
runs in waves: fill, compute, unpin, refill. A span of many tokens streams (streaming.py): it
keeps a share of the cache resident from one streamed step to the next and streams the other
experts through the rest in double-buffered waves, its kept experts first; its guess is the next
layer's whole ranking, copied into the expert slots its last waves free, so the next layer's
copies fly while this one finishes. Neither caching, streaming nor the CPU changes the math.

A short span (a decode token, a draft, a verify pass) replayed as piecewise CUDA graphs
(moe_serve/engine/graphs.py) does the same host work between two graphs: `capturing` splits the capture at
each layer's expert call, `replay_layer` reads the routing, makes the layer's experts resident in
one wave and writes their expert slots for the next graph; a span that needs every expert of the
model streams eagerly instead (can_replay). A self-draft (LayerRouting.candidates) runs
the resident experts of its top-k first. `recording` collects the experts each layer ran (the
verify pass's, which speculative decoding scores its expert predictions against).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, replace
from itertools import chain
from typing import Protocol

import torch

from moe_serve.engine.config import EngineConfig, parse_budget
from moe_serve.engine.experts.cache import CopyFn, ExpertCache, ExpertSource, Wave, copy_row
from moe_serve.engine.experts.compute import accumulate_experts, gathered_experts, reads_expert_slots_in_place
from moe_serve.engine.experts.cpu_experts import (
    CPU_EXPERT_MODES,
    CpuExperts,
    CpuJob,
    ExpertCosts,
    profile_costs,
)
from moe_serve.engine.experts.policies import MRSPolicy, make_policy
from moe_serve.engine.experts.predictor import Guess, NextLayerPredictor, token_topk
from moe_serve.engine.experts.routing import LayerRouting, Router, resident_first
from moe_serve.engine.experts.stats import StatsSnapshot
from moe_serve.engine.experts.streaming import (
    MIN_WAVE_BYTES,
    StreamExpertSlots,
    layer_waves,
    saturates,
    stream_guess,
    streams,
)

PREFETCH_MODES = ("none", "next-layer")


class RoutingObserver(Protocol):
    def on_layer(self, routing: LayerRouting, next_guess: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """`next_guess`: the next-layer predictor's per-token (probs, ids) [T, k] for layer + 1."""


def layer_scores(router_probs: torch.Tensor, top_p: int) -> torch.Tensor:
    """MRS's s for one layer run: per token only its top-p probabilities, averaged over tokens. [E]"""
    top = router_probs.float().topk(min(top_p, router_probs.shape[-1]), dim=-1)  # [T, p]
    scores = torch.zeros(router_probs.shape[-1], device=router_probs.device)
    return scores.scatter_add_(0, top.indices.reshape(-1), top.values.reshape(-1)) / router_probs.shape[0]


@dataclass(frozen=True)
class ReadBack:
    """What the host learns in a layer run's one sync."""

    ids: list[list[int]]  # [T][k] each token's experts
    experts: list[int]  # the distinct ones, ascending
    ranked: list[list[int]]  # [d][m] the next-layer guess per predicted layer; empty without one
    candidates: list[list[int]]  # [T][K] a self-draft's full top-k (LayerRouting.candidates); else empty


@dataclass
class CapturedLayer:
    """One MoE layer of a piecewise-captured span of T tokens (see moe_serve/engine/graphs.py).

    The segment ending at this layer leaves its packed read-back in `readback`; the host decides
    where the layer's experts are and writes their expert slots (and, for a self-draft, which
    experts) into `index`, which the next segment's expert compute reads. Both keep fixed addresses."""

    layer: int
    k: int  # experts each token runs
    num_candidates: int  # a self-draft's top-k it picks them from (0: not a draft)
    readback: torch.Tensor  # flat, as _pack makes it
    index: torch.Tensor  # [2, T, k] int64: the expert slot of each expert a token runs, then its expert id
    guess: Guess | None
    # index's host side, pinned on CUDA; made at the first replay, as a pinned allocation is not
    # allowed while a stream captures; rewritten only after the next read-back's sync
    staging: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return self.index.shape[1]


@dataclass
class _Held:
    """A replayed layer's experts, pinned until the next segment (which reads them) is enqueued."""

    wave: Wave
    prefetches: list[tuple[int, int]]  # (layer, expert) keys


def _chunks(values: list, size: int) -> list[list[int]]:
    return [[int(v) for v in values[i : i + size]] for i in range(0, len(values), size)]


def _capturing(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def _to_device(values: list, device: torch.device) -> torch.Tensor:
    """A small host list on the device without a host sync (pinned staging on CUDA)."""
    if device.type != "cuda":
        return torch.tensor(values, device=device)
    return torch.tensor(values, pin_memory=True).to(device, non_blocking=True)


class CachedExpertRunner:
    def __init__(self, store: ExpertSource, budget: int | float | None, policy: str = "lru",
                 device: torch.device | str = "cpu", *, top_k: int, prefetch: str = "none",
                 prefetch_depth: int = 1, copy_fn: CopyFn = copy_row,
                 observer: RoutingObserver | None = None, cpu_experts: str = "off",
                 cpu_costs: ExpertCosts | None = None, stream_prefill: bool = True,
                 min_wave_bytes: int = MIN_WAVE_BYTES) -> None:
        """`budget`: bytes (int), fraction of all expert bytes (float) or None for all experts.
        `cpu_costs` replaces the start-up profile of cpu_experts='auto' (tests). `stream_prefill`:
        long spans (streaming.streams) keep experts resident across steps, stream the others in
        double-buffered waves and prefetch the next layer's whole guess; off only for A/B timings.
        `min_wave_bytes`: the least a streamed wave copies (streaming.MIN_WAVE_BYTES; tests lower it
        to stream a small store the way the GPU streams large experts)."""
        if prefetch not in PREFETCH_MODES:
            raise ValueError(f"unknown prefetch mode {prefetch!r}; choose one of {', '.join(PREFETCH_MODES)}")
        if cpu_experts not in CPU_EXPERT_MODES:
            raise ValueError(f"unknown cpu-experts mode {cpu_experts!r}; choose one of {', '.join(CPU_EXPERT_MODES)}")
        self.store = store
        self._layouts = store.layouts  # per layer: how its experts' rows decode
        self._num_experts = store.num_experts
        self.top_k = top_k
        self.prefetch_depth = prefetch_depth
        eviction = make_policy(policy, top_k, store.num_layers, store.num_experts)
        self._mrs_top_p = eviction.top_p if isinstance(eviction, MRSPolicy) else None
        self.cache = ExpertCache(store, budget, eviction, device, top_k, copy_fn)
        self._num_layers = store.num_layers
        self._stream_expert_slots = StreamExpertSlots.of(self.cache.capacity, store.row_nbytes, store.num_layers,
                                                         min_wave_bytes)
        self.prefetch_mode = prefetch
        self.stream_prefill = stream_prefill
        self._observer = observer
        self._router_weights: list[torch.Tensor] = []
        self._router, self._corrections = Router(), None  # how the routers choose (set_router_weights)
        self._logit_biases: list[torch.Tensor] | None = None
        self._predictor: NextLayerPredictor | None = None
        self._cpu: CpuExperts | None = None
        if cpu_experts == "auto" and self.cache.resident_expert_slots is None:  # all resident: nothing is ever missed
            self._cpu = CpuExperts(store, cpu_costs or profile_costs(store, self.cache.device))
        self._capture: tuple[Callable[[], None], list[CapturedLayer]] | None = None
        self._held: _Held | None = None
        self._recording: dict[int, set[int]] | None = None

    @classmethod
    def from_config(cls, store: ExpertSource, config: EngineConfig, *, top_k: int,
                    observer: RoutingObserver | None = None) -> CachedExpertRunner:
        budget = parse_budget(config.gpu_expert_budget) if config.gpu_expert_budget is not None else None
        return cls(store, budget, config.cache_policy, config.device, top_k=top_k, prefetch=config.prefetch,
                   prefetch_depth=config.prefetch_depth, observer=observer, cpu_experts=config.cpu_experts)

    def set_router_weights(self, weights: Sequence[torch.Tensor], router: Router = Router(),
                           corrections: Sequence[torch.Tensor] | None = None,
                           logit_biases: Sequence[torch.Tensor] | None = None) -> None:
        """Hook in the model's routers ([E, H] per MoE layer) for the predictor and traces, and how
        they choose (the family's Router, each layer's correction bias [E] and its linear's bias [E]
        where it has them)."""
        self._router_weights = list(weights)
        self._router, self._corrections = router, (list(corrections) if corrections is not None else None)
        self._logit_biases = list(logit_biases) if logit_biases is not None else None
        if self.prefetch_mode == "next-layer":
            self._predictor = NextLayerPredictor(self._router_weights, self.top_k, self.prefetch_depth,
                                                 self.cache.stats, router=router, corrections=corrections,
                                                 logit_biases=logit_biases)

    def run(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        if self.prefetch_mode == "next-layer" and self._predictor is None:
            raise RuntimeError("prefetch='next-layer' needs set_router_weights(model.router_weights()) first")
        if self._capture is not None:  # nothing runs now, so nothing is counted
            return self._run_captured(x, routing)
        if self.graph_safe and (x.shape[0] == 1 or _capturing(x)
                                or reads_expert_slots_in_place(x, self.cache.expert_slots, self._layouts[routing.layer])):
            return self._run_resident(x, routing)
        layer = routing.layer
        self.cache.begin_run(layer)
        streamed = self.stream_prefill and streams(x.shape[0], self.top_k, self._num_experts)
        if not streamed:
            self.cache.keep_nothing()  # the streamed spans' kept experts: a shorter span may need any expert slot
        guess = self._guess(layer, x, streamed)
        read = self._read_back(routing, guess)
        back = self._draft_choice(layer, read)
        if back.ids != read.ids:
            ids = _to_device(back.ids, x.device)  # [T, r]
            routing = replace(routing, expert_ids=ids, expert_weights=routing.reweighted(ids))
        self._record(layer, back)
        if self._observer is not None:
            self._observer.on_layer(routing, self._next_guess(layer, x, guess))
        job = self._start_cpu(x, routing, back) if self._cpu is not None else None
        on_gpu = back.experts if job is None else [e for e in back.experts if e not in job.experts]
        tail = self._prefetch_next(layer, back.ranked[0]) if streamed and guess is not None else None
        out = self._run_on_gpu(x, routing, back.ids, on_gpu, streamed=streamed, tail=tail)
        if guess is not None and not streamed:  # after this layer's compute is queued: the GPU works meanwhile
            self.cache.prefetch(self._predictor.remember(guess, back.ranked))
        return out if job is None else self._cpu.finish(job, out)

    def _prefetch_next(self, layer: int, ranked: list[int]) -> Callable[[], None]:
        """A streamed layer's tail (streaming.layer_waves): the next layer's guessed experts, most
        routed first, into whatever room the waves it released leave; never the expert slot of a
        kept expert."""
        keys = [(layer + 1, e) for e in ranked if e >= 0]
        return lambda: self.cache.prefetch(keys, within_room=True)

    def _guess(self, layer: int, x: torch.Tensor, streamed: bool) -> Guess | None:
        """Launched before the layer's one sync, read back with it. A streamed span guesses the next
        layer's whole ranking, not the predictor's few: its accuracy counters describe short spans."""
        if not streamed:
            return self._predictor.guess(layer, x) if self._predictor is not None else None
        if self.cache.resident_expert_slots is None and layer + 1 < len(self._router_weights):
            return stream_guess(x, self._router_weights[layer + 1], self.top_k, layer + 1, self.cache.capacity,
                                self._router, *self._biases(layer + 1))
        return None

    @property
    def cpu_costs(self) -> ExpertCosts | None:
        """The cost model deciding which misses run on the CPU; None when --cpu-experts is off."""
        return self._cpu.costs if self._cpu is not None else None

    @property
    def graph_safe(self) -> bool:
        """Every expert resident and no per-layer observer: an eager token or a captured span needs no host sync."""
        return self.cache.resident_expert_slots is not None and self._observer is None

    def _run_resident(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        """Every expert resident: no host sync, so CUDA graphs can capture it. Eagerly for one token,
        or any number where the kernels read the expert slots in place (a prefill on the GPU: the
        cache's path would sync on every layer's experts, ~4 ms a layer of host work for a short
        prompt on an H100). Counted as T*k hits, as replays are (count_replayed_tokens): the
        distinct experts are not known without a sync; while a graph is being captured nothing is
        counted — a replay runs no Python, so the graph's owner counts replays."""
        if not _capturing(x):
            self.cache.stats.add(routing.layer, hits=routing.expert_ids.numel())
        expert_slot_ids = self.cache.resident_expert_slots[routing.layer][routing.expert_ids]  # [T, k]
        return gathered_experts(x, routing.expert_weights, self.cache.expert_slots, expert_slot_ids,
                                self._layouts[routing.layer], self._num_experts)

    @property
    def replayable(self) -> bool:
        """Short spans can be captured piecewise: every host decision is the cache's, made
        between segments (a per-layer observer or CPU experts need the eager path)."""
        return self.cache.device.type == "cuda" and self._observer is None and self._cpu is None

    def can_replay(self, tokens: int) -> bool:
        """A replayed layer computes all its experts in one wave: the cache must hold the most
        distinct experts `tokens` tokens can route to.

        A span that needs every expert of the model (streaming.saturates) runs eagerly wherever
        streaming keeps experts: each replayed layer would pin all E of its experts at once, so at
        most C - E experts could stay resident across a step (LRU keeps none), while the stream
        keeps C - 2 waves. At Mixtral size and a 25% budget that is 38 copies a step instead of
        48: ~70 ms of PCIe saved against an eager step's extra host work (~10 ms, an estimate).
        Shorter spans (a decode token, a draft, a verify pass of up to 13 tokens at 6 layers x 8
        experts, top-2) replay."""
        if self._keeps and saturates(tokens, self.top_k, self._num_experts, self._num_layers):
            return False
        return min(tokens * self.top_k, self._num_experts) <= self.cache.capacity

    @property
    def _keeps(self) -> bool:
        """Whether streamed spans keep experts resident (streaming.StreamExpertSlots)."""
        return self.stream_prefill and self.cache.resident_expert_slots is None and self._stream_expert_slots.kept > 0

    @contextmanager
    def recording(self) -> Iterator[dict[int, set[int]]]:
        """Collect, per MoE layer, the experts the layer runs started meanwhile ran (eager or replayed)."""
        used: dict[int, set[int]] = {}
        self._recording = used
        try:
            yield used
        finally:
            self._recording = None

    @contextmanager
    def capturing(self, split: Callable[[], None]) -> Iterator[list[CapturedLayer]]:
        """While a short forward is being captured piecewise: each MoE layer packs its read-back,
        calls `split` (end this graph, begin the next) and computes its experts from expert slot ids
        that replay_layer fills in. Yields the layers in order as they are captured."""
        layers: list[CapturedLayer] = []
        self._capture = (split, layers)
        try:
            yield layers
        finally:
            self._capture = None

    def _run_captured(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        split, layers = self._capture
        guess = self._predictor.guess(routing.layer, x) if self._predictor is not None else None
        readback = self._pack(routing, guess)
        # host-written between replays; zeroed in this segment, i.e. before the host writes it,
        # so that where "capture" runs eagerly (CPU tests) the experts below read valid expert slots
        index = torch.zeros((2, *routing.expert_ids.shape), dtype=torch.long, device=x.device)
        num_candidates = 0 if routing.candidates is None else routing.candidates.shape[1]
        layers.append(CapturedLayer(routing.layer, routing.expert_ids.shape[1], num_candidates, readback, index, guess))
        split()
        weights = routing.expert_weights if routing.candidates is None else routing.reweighted(index[1])
        return gathered_experts(x, weights, self.cache.expert_slots, index[0], self._layouts[routing.layer],
                                self._num_experts)

    def replay_layer(self, captured: CapturedLayer) -> None:
        """The host's part of a replayed step between the segment ending at `captured` and the next:
        the layer's one sync (its routing), its experts made resident in one wave, their expert
        slots handed to the next segment. Call right after replaying the segment that ends here."""
        self._release_held()  # the previous layer's compute is enqueued: its expert slots may go
        layer = captured.layer
        self.cache.begin_run(layer)
        self.cache.keep_nothing()  # the whole wave must fit: no expert slot stays a streamed span's
        back = self._unpack(captured.readback.tolist(), layer, captured.tokens, captured.k, captured.num_candidates,
                            captured.guess)
        back = self._draft_choice(layer, back)
        self._record(layer, back)
        wave = self.cache.acquire(layer, back.experts, whole=True)
        self.cache.wait_pending(wave)
        # The read-back above synchronised the stream after the previous replay's copy from the
        # staging buffer, so it may be rewritten; a fixed pinned buffer spares an allocation per layer.
        if captured.staging is None:
            captured.staging = torch.empty(captured.index.shape, dtype=torch.long, pin_memory=captured.index.is_cuda)
        flat = [e for row in back.ids for e in row]
        captured.staging.numpy().reshape(-1)[:] = [wave.expert_slots[e] for e in flat] + flat
        captured.index.copy_(captured.staging, non_blocking=True)
        prefetches = self._predictor.remember(captured.guess, back.ranked) if captured.guess is not None else []
        self._held = _Held(wave, prefetches)

    def finish_replay(self) -> None:
        """After the step's last segment is enqueued: release the last layer's experts."""
        self._release_held()

    def _release_held(self) -> None:
        held, self._held = self._held, None
        if held is None:
            return
        self.cache.release(held.wave)
        self.cache.prefetch(held.prefetches)

    def count_replayed_tokens(self, tokens: int, experts_per_layer: int) -> None:
        """Book tokens replayed by a one-piece CUDA graph: each MoE layer used that many resident
        experts per token (a span's distinct count would need the host; T x k bounds it)."""
        self.cache.stats.add_every_layer(hits=tokens * experts_per_layer)

    def finish_step(self) -> None:
        """Call once per engine step, after the step's natural sync (the sampled token was read)."""
        self.cache.finish_step()

    def stats(self) -> StatsSnapshot:
        return self.cache.stats.snapshot()

    @property
    def resident_experts(self) -> int:
        return self.cache.resident_experts

    def close(self) -> None:
        if self._cpu is not None:
            self._cpu.close()

    def _read_back(self, routing: LayerRouting, guess: Guess | None) -> ReadBack:
        """The layer's one host sync: its routing, MRS scores and the next-layer guess in one transfer."""
        t, k = routing.expert_ids.shape
        num_candidates = 0 if routing.candidates is None else routing.candidates.shape[1]
        return self._unpack(self._pack(routing, guess).tolist(), routing.layer, t, k, num_candidates, guess)

    def _pack(self, routing: LayerRouting, guess: Guess | None) -> torch.Tensor:
        """What the host reads after a layer's routing, as one flat device tensor."""
        parts = [routing.expert_ids.reshape(-1)]  # [T*k]
        if routing.candidates is not None:
            parts.append(routing.candidates.reshape(-1))  # [T*K]
        if self._mrs_top_p is not None:
            parts.append(layer_scores(routing.router_probs, self._mrs_top_p))  # [E]
        if guess is not None:
            parts.append(guess.ranked.reshape(-1))  # [d*m]
        if len(parts) == 1:
            return parts[0]
        dtype = torch.float32 if self._mrs_top_p is not None else torch.long  # ids < 2**24: exact as floats
        return torch.cat([p.to(dtype) for p in parts])

    def _unpack(self, flat: list, layer: int, t: int, k: int, num_candidates: int, guess: Guess | None) -> ReadBack:
        ids, rest = _chunks(flat[: t * k], k), flat[t * k :]
        candidates, rest = _chunks(rest[: t * num_candidates], num_candidates or 1), rest[t * num_candidates :]
        if self._mrs_top_p is not None:
            self.cache.observe_scores(layer, rest[: self._num_experts])
            rest = rest[self._num_experts :]
        ranked = _chunks(rest, guess.ranked.shape[1]) if guess is not None else []
        return ReadBack(ids, sorted({e for row in ids for e in row}), ranked, candidates)

    def _record(self, layer: int, back: ReadBack) -> None:
        if self._predictor is not None:
            self._predictor.record_used(layer, back.experts)
        if self._recording is not None:
            self._recording.setdefault(layer, set()).update(back.experts)

    def _draft_choice(self, layer: int, back: ReadBack) -> ReadBack:
        """A self-draft runs r experts per token: resident ones among its top-k first (SS-MoE), so
        drafting copies an expert only when none of a token's top-k is on the device."""
        if not back.candidates:
            return back
        r = len(back.ids[0])
        missing = set(self.cache.missing(layer, sorted({e for row in back.candidates for e in row})))
        chosen = [resident_first(row, r, missing) for row in back.candidates]
        return ReadBack(chosen, sorted({e for row in chosen for e in row}), back.ranked, back.candidates)

    def _next_guess(self, layer: int, x: torch.Tensor, guess: Guess | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if guess is not None:
            return guess.next_layer()
        if layer + 1 < len(self._router_weights):
            return token_topk(x, self._router_weights[layer + 1], self.top_k, self._router, *self._biases(layer + 1))
        return None

    def _biases(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The layer's router correction bias and logit bias, each None where the family has none."""
        return tuple(None if biases is None else biases[layer] for biases in (self._corrections, self._logit_biases))

    def _start_cpu(self, x: torch.Tensor, routing: LayerRouting, back: ReadBack) -> CpuJob | None:
        missing = self.cache.missing(routing.layer, back.experts)
        if not missing:
            return None
        tokens = Counter(e for row in back.ids for e in row)  # a token's k experts are distinct
        job = self._cpu.start(x, routing, back.ids, {e: tokens[e] for e in missing})
        if job is not None:
            self.cache.stats.add(routing.layer, misses=len(job.experts), cpu_expert_computations=len(job.experts))
        return job

    def _run_on_gpu(self, x: torch.Tensor, routing: LayerRouting, ids: list[list[int]], experts: list[int], *,
                    streamed: bool, tail: Callable[[], None] | None) -> torch.Tensor:
        """The sum over the token's `experts` (the ones not left to the CPU) from the GPU cache. [T, H]
        `tail`: called once nothing of the layer is left to copy (streaming.layer_waves)."""
        if not experts:
            if tail is not None:
                tail()
            return torch.zeros_like(x)
        keep = self._stream_expert_slots.quota(routing.layer) if streamed and self._keeps else 0
        with closing(layer_waves(self.cache, routing.layer, experts, double_buffer=streamed, keep=keep,
                                 tail=tail)) as waves:
            first = next(waves)
            if x.shape[0] == 1 and len(first.keys) == len(experts):
                return self._compute_gathered(x, routing, first, ids[0])
            out = torch.zeros_like(x)  # [T, H]
            for wave in chain([first], waves):
                self._compute(out, x, routing, wave, ids)
        return out

    def _compute_gathered(self, x: torch.Tensor, routing: LayerRouting, wave: Wave, ids: list[int]) -> torch.Tensor:
        """One token whose GPU experts all fit in this wave: wait for its copies, then one gathered
        batched matmul; the expert slot ids travel with a non-blocking copy, so no second host sync."""
        self.cache.wait_pending(wave)
        keep = [j for j, e in enumerate(ids) if e in wave.expert_slots]  # positions in the top-k not left to the CPU
        # [2, k']: expert slot, position
        index = _to_device([[wave.expert_slots[ids[j]] for j in keep], keep], x.device)
        weights = routing.expert_weights if len(keep) == len(ids) else routing.expert_weights[:, index[1]]
        return gathered_experts(x, weights, self.cache.expert_slots, index[:1], self._layouts[routing.layer],
                                self._num_experts)

    def _compute(self, out: torch.Tensor, x: torch.Tensor, routing: LayerRouting, wave: Wave,
                 ids: list[list[int]]) -> None:
        """out [T, H] += the wave's experts over their tokens: the landed ones while the others' copies
        fly, then the rest. `ids`: the routing as read back, [T][k] expert ids."""
        layout = self._layouts[routing.layer]
        if layout.quantized and reads_expert_slots_in_place(x, self.cache.expert_slots, layout):
            # the torch path decodes every expert whole before its matmuls: for int4 at Mixtral size
            # ~2 ms an expert on an H200, 110 ms of a 32-sequence step's 140
            # (bench/results/quant/step-profile-int4-25-bs32-h200.json); the kernels decode tiles as they read them
            def add(landed: bool) -> None:
                self._add_in_place(out, x, routing, ids, wave.slots(landed=landed))
        else:
            def add(landed: bool) -> None:
                rows = wave.rows(landed=landed)
                if rows:
                    accumulate_experts(out, x, routing.expert_ids, routing.expert_weights, rows, layout)
        add(True)  # runs while the wave's copies are in flight
        if not wave.pending:
            return
        self.cache.wait_pending(wave)
        # One call for all copied experts: each accumulate_experts call syncs the host twice
        # (~0.4 ms on H100), more than one expert's copy takes, so per-expert calls lose.
        add(False)

    def _add_in_place(self, out: torch.Tensor, x: torch.Tensor, routing: LayerRouting, ids: list[list[int]],
                      expert_slots: dict[int, int]) -> None:
        """out [T, H] += the experts of `expert_slots` (expert -> expert slot) over the tokens routed to
        them, by the expert kernels reading the expert slots in place. Each (token, j) pair is a row of
        its own (top-1), listed from the host's routing: no host sync. Pairs go by position j, then token,
        so each position's index_add_ adds to distinct rows of out: deterministic."""
        pairs = [(t, j, expert_slots[row[j]]) for j in range(len(ids[0])) for t, row in enumerate(ids)
                 if row[j] in expert_slots]
        if not pairs:
            return
        tokens, positions, slots = _to_device(list(zip(*pairs)), x.device)  # [P] each
        y = gathered_experts(x.index_select(0, tokens), routing.expert_weights[tokens, positions][:, None],
                             self.cache.expert_slots, slots[:, None], self._layouts[routing.layer],
                             self._num_experts)  # [P, H]
        start = 0
        for count in Counter(j for _, j, _ in pairs).values():  # the pairs of each position, in turn
            out.index_add_(0, tokens[start : start + count], y[start : start + count])
            start += count
