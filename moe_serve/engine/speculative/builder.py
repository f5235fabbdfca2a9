"""Build the speculative decoder an EngineConfig asks for: who drafts, who prefetches, which cutoff."""
from __future__ import annotations

import logging
from typing import Callable

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.decode import BoundModel
from moe_serve.engine.experts.runner import CachedExpertRunner
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.draft_spec import DraftSpecDecoder
from moe_serve.engine.speculative.loop import Drafter, SpecDecoder
from moe_serve.engine.speculative.profile import SpecProfile, plan_cutoff, profile_drafting, profile_expert_load
from moe_serve.engine.speculative.self_spec import SelfSpecDecoder
from moe_serve.engine.speculative.stats import SpecStats

log = logging.getLogger(__name__)


def build_spec_decoder(config: EngineConfig, target: BoundModel, runner: CachedExpertRunner | None,
                       load_draft: Callable[[], BoundModel], stats: SpecStats) -> SpecDecoder:
    spec = SpecConfig.from_engine(config)
    if config.spec == "self":
        return _self_decoder(spec, target, runner, stats)
    if config.spec == "draft":
        if not config.draft:
            raise ValueError("--spec draft needs --draft DIR (a dense draft model with the target's tokenizer)")
        return _draft_decoder(spec, target, load_draft(), runner, stats)
    raise ValueError(f"unknown spec mode {config.spec!r}; choose off, self or draft")


def _prefetching(runner: CachedExpertRunner | None) -> bool:
    """Speculative prefetch only matters when some experts live off the device."""
    return runner is not None and not runner.graph_safe


def _self_decoder(spec: SpecConfig, target: BoundModel, runner: CachedExpertRunner | None,
                  stats: SpecStats) -> SelfSpecDecoder:
    cfg = target.model.config
    if not _prefetching(runner):
        return SelfSpecDecoder(target, spec, stats=stats)
    profile = SpecProfile(profile_drafting(Drafter(target, moe_top_r=spec.top_r), cfg.num_layers),
                          profile_expert_load(runner.store.row_nbytes, target.device))
    cutoff = plan_cutoff(spec, cfg, cfg.num_layers, cfg.top_k - spec.top_r, runner.store.row_nbytes,
                         runner.cache.capacity, profile)
    log.info("SS-MoE self-draft: top-r=%d, prefetching the k-r extra experts of MoE layers < %d; profile %s",
             spec.top_r, cutoff, profile)
    return SelfSpecDecoder(target, spec, runner.cache, cutoff, stats)


def _draft_decoder(spec: SpecConfig, target: BoundModel, draft: BoundModel, runner: CachedExpertRunner | None,
                   stats: SpecStats) -> DraftSpecDecoder:
    cfg, depth = target.model.config, draft.model.config.num_layers
    if not _prefetching(runner):
        return DraftSpecDecoder(target, draft, spec, stats=stats)
    profile = SpecProfile(profile_drafting(Drafter(draft), depth), profile_expert_load(runner.store.row_nbytes, draft.device))
    cutoff = plan_cutoff(spec, cfg, depth, cfg.top_k, runner.store.row_nbytes, runner.cache.capacity, profile)
    log.info("SP-MoE draft: cross-model prefetch for target MoE layers < %d; profile %s", cutoff, profile)
    return DraftSpecDecoder(target, draft, spec, runner.cache, cutoff, stats)
