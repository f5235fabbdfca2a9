"""Everything one engine needs, built from an EngineConfig: model, expert store/cache, decoder.

Also the one place that turns the engine's internal counters into the numbers users see
(`moe-generate --json` stats and the server's MetricsSnapshot).
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace

import torch

from moe_serve.engine.config import EngineConfig, resolve_max_model_len
from moe_serve.engine.decode import BoundModel, Decoder
from moe_serve.engine.experts.runner import CachedExpertRunner
from moe_serve.engine.experts.stats import LayerStats, StatsSnapshot
from moe_serve.engine.graphs import GraphedBatchStep, GraphedDecode
from moe_serve.engine.kv.block_manager import blocks_for
from moe_serve.engine.kv.paged_cache import PagedKVCache, kv_bytes_per_token
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.loader import load_model, open_checkpoint, read_config, resolve_dtype
from moe_serve.engine.memory_plan import MemoryPlan, plan_memory
from moe_serve.engine.messages import MetricsSnapshot
from moe_serve.engine.model_runner import ModelRunner
from moe_serve.engine.models.blocks import CausalLM
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.scheduler import SchedulerConfig
from moe_serve.engine.speculative.batched import BatchedSpeculator
from moe_serve.engine.speculative.builder import build_spec_decoder
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.stats import SpecStats
from moe_serve.engine.trace import RoutingRecorder

log = logging.getLogger(__name__)
KV_BLOCK_SIZE = 16  # token positions per KV block (vLLM's default)


def _difference(now: StatsSnapshot, before: StatsSnapshot | None) -> LayerStats:
    total = now.total()
    if before is None:
        return total
    base = before.total()
    return LayerStats(**{f.name: getattr(total, f.name) - getattr(base, f.name) for f in fields(total)})


@dataclass
class Runtime:
    config: EngineConfig
    model_config: ModelConfig
    target: BoundModel  # the model over a one-sequence cache: speculative decoding, references, benchmarks
    runner: CachedExpertRunner | None
    decoder: Decoder | None  # the speculative decoder (--spec), for sequences decoding alone
    batch_runner: ModelRunner  # every scheduled sequence in one forward
    speculator: BatchedSpeculator | None  # --spec for a batch of decoding sequences, over the paged cache
    scheduler_config: SchedulerConfig
    max_model_len: int
    spec_stats: SpecStats = field(default_factory=SpecStats)
    recorder: RoutingRecorder | None = None
    _stats_base: StatsSnapshot | None = None
    _spec_base: SpecStats = field(default_factory=SpecStats)

    def finish_step(self) -> None:
        if self.runner is not None:
            self.runner.finish_step()

    def expert_stats(self) -> StatsSnapshot:
        return self.runner.stats() if self.runner is not None else StatsSnapshot(())

    def reset_stats(self) -> None:
        """Start a new measurement window for generation_stats (benchmarks, one prompt each)."""
        self._stats_base = self.expert_stats()
        self._spec_base = copy.deepcopy(self.spec_stats)

    def generation_stats(self, *, ttft_seconds: float | None, tpot_seconds: float | None) -> dict:
        """The `stats` object of `moe-generate --json` for the current measurement window."""
        total = _difference(self.expert_stats(), self._stats_base)
        return {
            "expert_hits": total.hits,
            "expert_misses": total.misses,
            "hit_rate": total.hit_rate,
            "pcie_bytes": total.demand_bytes + total.prefetch_bytes,
            "expert_format": self.runner.store.format_name if self.runner is not None else None,
            "expert_bytes": self.runner.store.row_nbytes if self.runner is not None else 0,  # one expert slot
            "pcie_wait_seconds": total.pcie_wait_seconds,
            "prefetch_used": total.prefetch_used,
            "prefetch_wasted": total.prefetch_wasted,
            "cpu_expert_computations": total.cpu_expert_computations,
            "tpot_seconds": tpot_seconds,
            "ttft_seconds": ttft_seconds,
            **self._spec_window(),
        }

    def _spec_window(self) -> dict:
        if self.config.spec == "off":
            return {}
        now, base = self.spec_stats, self._spec_base
        drafted = now.draft_tokens - base.draft_tokens
        accepted = now.accepted_tokens - base.accepted_tokens
        drafts = now.drafts - base.drafts
        needed = sum(now.needed_per_layer) - sum(base.needed_per_layer)
        predicted = sum(now.predicted_needed_per_layer) - sum(base.predicted_needed_per_layer)
        return {
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_length": accepted / drafts if drafts else 0.0,
            "prediction_accuracy": predicted / needed if needed else None,
            "verify_steps": now.verify_steps - base.verify_steps,
            "draft_seconds": now.draft_seconds - base.draft_seconds,
            "verify_seconds": now.verify_seconds - base.verify_seconds,
        }

    def metrics_snapshot(self, *, num_running: int, num_waiting: int, tpot_samples: tuple[float, ...]) -> MetricsSnapshot:
        stats = self.expert_stats()
        total = stats.total()
        return MetricsSnapshot(
            cache_hits_per_layer=stats.column("hits"),
            cache_misses_per_layer=stats.column("misses"),
            resident_experts=self.runner.resident_experts if self.runner is not None else 0,
            pcie_bytes_demand=total.demand_bytes,
            pcie_bytes_prefetch=total.prefetch_bytes,
            pcie_wait_seconds=total.pcie_wait_seconds,
            prefetch_used=total.prefetch_used,
            prefetch_wasted=total.prefetch_wasted,
            spec_drafts=self.spec_stats.drafts,
            spec_draft_tokens=self.spec_stats.draft_tokens,
            spec_accepted_tokens=self.spec_stats.accepted_tokens,
            spec_verify_steps=self.spec_stats.verify_steps,
            spec_accepted_at_position=tuple(self.spec_stats.accepted_at_position),
            spec_needed_per_layer=tuple(self.spec_stats.needed_per_layer),
            spec_predicted_needed_per_layer=tuple(self.spec_stats.predicted_needed_per_layer),
            spec_draft_seconds=self.spec_stats.draft_seconds,
            spec_verify_seconds=self.spec_stats.verify_seconds,
            cpu_expert_computations=total.cpu_expert_computations,
            num_running=num_running,
            num_waiting=num_waiting,
            tpot_samples=tpot_samples,
            expert_format=self.runner.store.format_name if self.runner is not None else "",
            expert_bytes=self.runner.store.row_nbytes if self.runner is not None else 0,
        )

    def describe(self) -> dict:
        cfg = self.config
        costs = self.runner.cpu_costs if self.runner is not None else None
        return {
            "model": cfg.model, "device": cfg.device, "architecture": self.model_config.architecture,
            "gpu_expert_budget": cfg.gpu_expert_budget, "cache_policy": cfg.cache_policy,
            "prefetch": cfg.prefetch, "cpu_experts": cfg.cpu_experts, "spec": cfg.spec,
            "expert_format": self.runner.store.describe_formats() if self.runner is not None else None,
            "expert_bytes": self.runner.store.row_nbytes if self.runner is not None else 0,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler_config.max_num_batched_tokens,
            "kv_blocks": self.scheduler_config.num_blocks, "kv_block_size": self.scheduler_config.block_size,
            "cuda_graphs": self.target.graphs is not None,
            "cache_slots": self.runner.cache.capacity if self.runner is not None else 0,
            "cpu_expert_costs": asdict(costs) if costs is not None else None,
        }

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.recorder is not None:
            self.recorder.close()


def _graphs(config: EngineConfig, model, kv: KVCache, runner: CachedExpertRunner | None) -> GraphedDecode | None:
    """CUDA graphs for short forwards (decode, draft, verify): whole when nothing needs the host, piecewise
    around each MoE layer's cache decision when experts are offloaded."""
    return GraphedDecode(model, kv, runner) if _graphable(config, model, kv.keys, runner) else None


def _graphable(config: EngineConfig, model, cache: torch.Tensor, runner: CachedExpertRunner | None) -> bool:
    if not (config.cuda_graphs and cache.is_cuda and model.supports_static_forward):
        return False
    return runner is None or runner.graph_safe or runner.replayable


def _with_prefetch_fallback(config: EngineConfig) -> EngineConfig:
    """SP-MoE predicts the target's experts from the draft's hidden states, which needs equal
    hidden sizes; without that the next-layer predictor is the prefetcher (said at start-up)."""
    if config.spec != "draft" or not config.draft or config.prefetch != "none":
        return config
    target, draft = read_config(config.model), read_config(config.draft)
    if not target.is_moe or target.hidden_size == draft.hidden_size:
        return config
    log.warning("draft hidden size %d != target %d: cross-model prediction is off, using --prefetch next-layer",
                draft.hidden_size, target.hidden_size)
    return replace(config, prefetch="next-layer")


def build_runtime(config: EngineConfig) -> Runtime:
    config = _with_prefetch_fallback(config)
    device = torch.device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    checkpoint = open_checkpoint(config.model)  # opened once: the config now, the tensors below
    model_config = checkpoint.config
    max_len = resolve_max_model_len(config.max_model_len, model_config)
    plan = _memory_plan(config, model_config, dtype, max_len, device)
    if config.gpu_expert_budget is None:
        config = replace(config, gpu_expert_budget=plan.expert_budget)
    runners: list[CachedExpertRunner] = []
    recorders: list[RoutingRecorder] = []

    def runner_factory(store, model_config: ModelConfig) -> CachedExpertRunner:
        if config.record_routing:
            recorders.append(RoutingRecorder(config.record_routing, model_config.top_k))
        observer = recorders[0] if recorders else None
        runners.append(CachedExpertRunner.from_config(store, config, top_k=model_config.top_k, observer=observer))
        return runners[-1]

    loaded = load_model(checkpoint, device, dtype, runner_factory=runner_factory, expert_quant=config.expert_quant)
    del checkpoint  # a GGUF reader holds its parsed metadata
    runner = runners[0] if runners else None
    if runner is not None:
        runner.set_router_weights(loaded.model.router_weights(), loaded.config.router,
                                  loaded.model.router_corrections(), loaded.model.router_logit_biases())
    kv = KVCache.for_model(loaded.config, max_len, device=device, dtype=dtype)
    recorder = recorders[0] if recorders else None
    target = BoundModel(loaded.model, kv, device, on_forward=recorder.begin_forward if recorder else None,
                        graphs=_graphs(config, loaded.model, kv, runner))
    spec_stats = SpecStats()
    decoder: Decoder | None = None
    drafts: list[CausalLM] = []
    if config.spec != "off":
        def load_draft() -> BoundModel:
            drafts.append(load_model(config.draft, device, dtype).model)
            draft_kv = KVCache.for_model(drafts[-1].config, max_len, device=device, dtype=dtype)
            return BoundModel(drafts[-1], draft_kv, device, graphs=_graphs(config, drafts[-1], draft_kv, None))

        decoder = build_spec_decoder(config, target, runner, load_draft, spec_stats)
    draft = drafts[0] if drafts else None
    scheduler_config = _batching(config, loaded.config, draft.config if draft else None, dtype, max_len,
                                 plan.kv_bytes)
    verify_tokens = config.spec_tokens + 1 if decoder is not None else None
    self_draft_top_r = config.spec_top_r if config.spec == "self" else None
    batch_runner = _model_runner(config, loaded.model, runner, scheduler_config, max_len, dtype, recorder,
                                 verify_tokens, self_draft_top_r)
    speculator = None
    if decoder is not None:
        draft_runner = None if draft is None else _model_runner(config, draft, None, scheduler_config, max_len, dtype)
        speculator = BatchedSpeculator(batch_runner, draft_runner, SpecConfig.from_engine(config), spec_stats)
    log.info("engine ready: %s", {"model": config.model, "device": str(device), "dtype": str(dtype),
                                  "spec": config.spec,
                                  "experts": runner.store.describe() if runner is not None else None})
    return Runtime(config, loaded.config, target, runner, decoder, batch_runner, speculator, scheduler_config, max_len,
                   spec_stats, recorder)


def _model_runner(config: EngineConfig, model: CausalLM, runner: CachedExpertRunner | None,
                  scheduler_config: SchedulerConfig, max_len: int, dtype: torch.dtype,
                  recorder: RoutingRecorder | None = None, verify_tokens: int | None = None,
                  self_draft_top_r: int | None = None) -> ModelRunner:
    """A model's batched forwards over a paged KV cache of the scheduler's blocks, with every step shape
    it can replay captured as a CUDA graph now (GraphedBatchStep.capture_shapes: for a speculating
    target also its verify passes of up to verify_tokens per sequence, and its self-drafts)."""
    paged = PagedKVCache.for_model(model.config, scheduler_config.num_blocks, KV_BLOCK_SIZE, device=model.device,
                                   dtype=dtype)
    graphs = None
    if _graphable(config, model, paged.keys, runner):
        graphs = GraphedBatchStep(model, paged, runner, config.max_num_seqs, config.max_num_batched_tokens,
                                  blocks_for(max_len, KV_BLOCK_SIZE))
        started = time.perf_counter()
        captured = graphs.capture_shapes(max_len, verify_tokens, self_draft_top_r)
        if runner is not None:
            runner.cache.stats.clear()
        log.info("captured CUDA graphs of %d batched step shapes of %s in %.1f s", captured, model.config.architecture,
                 time.perf_counter() - started)
    return ModelRunner(model, paged, max_len, on_forward=recorder.begin_forward if recorder else None, graphs=graphs)


def _memory_plan(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, max_len: int,
                 device: torch.device) -> MemoryPlan:
    draft = read_config(config.draft) if config.spec == "draft" and config.draft else None
    device_bytes = in_use = None
    if device.type == "cuda":
        free, device_bytes = torch.cuda.mem_get_info(device)  # creates the CUDA context first: it is counted
        in_use = device_bytes - free
    plan = plan_memory(config, model_config, draft, dtype, max_len, KV_BLOCK_SIZE, device_bytes, in_use or 0)
    log.info("memory plan: %s", plan.describe())
    return plan


def _batching(config: EngineConfig, model_config: ModelConfig, draft_config: ModelConfig | None, dtype: torch.dtype,
              max_len: int, kv_bytes: int) -> SchedulerConfig:
    """The scheduler's limits and the paged KV cache's size (memory_plan's), with the arithmetic in the log.
    With a draft model its paged cache has the same blocks (batched speculation), so a block costs both."""
    per_token = kv_bytes_per_token(model_config, dtype)
    draft_per_token = kv_bytes_per_token(draft_config, dtype) if draft_config is not None else 0
    per_block = (per_token + draft_per_token) * KV_BLOCK_SIZE
    num_blocks = kv_bytes // per_block
    scheduler_config = SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, num_blocks, KV_BLOCK_SIZE,
                                       max_len)
    draft_note = f" + {draft_per_token} of the draft model's" if draft_config is not None else ""
    log.info("KV cache: %d bytes per token%s, %d blocks of %d tokens = %.1f MiB: %d tokens, %.1f sequences of "
             "max_model_len %d (at most %d run at once, %d tokens per step)", per_token, draft_note, num_blocks,
             KV_BLOCK_SIZE, num_blocks * per_block / 2**20, num_blocks * KV_BLOCK_SIZE,
             num_blocks * KV_BLOCK_SIZE / max_len, max_len, config.max_num_seqs, config.max_num_batched_tokens)
    return scheduler_config
