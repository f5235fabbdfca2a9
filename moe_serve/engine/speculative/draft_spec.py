"""--spec draft --draft DIR (SP-MoE): a small dense model drafts; its attention outputs predict the
target's experts for the verify pass, which are prefetched while drafting continues.

Cross-model prediction feeds draft hidden states into the target's router, so it needs equal
hidden sizes; otherwise it is off (said once at start-up) and the runtime's next-layer predictor
is the only prefetcher.
"""
from __future__ import annotations

import logging

from moe_serve.engine.decode import BoundModel
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.cross_model import CrossModelPredictor, PrefetchSink
from moe_serve.engine.speculative.layer_map import layer_map
from moe_serve.engine.speculative.loop import Drafter, SpecDecoder
from moe_serve.engine.speculative.stats import SpecStats

log = logging.getLogger(__name__)


def check_draft(target: ModelConfig, draft: ModelConfig) -> None:
    """A draft must speak the target's vocabulary: token ids are compared one to one."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"draft vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}: "
                         "--draft must use the target's tokenizer")


class DraftSpecDecoder(SpecDecoder):
    def __init__(self, target: BoundModel, draft: BoundModel, config: SpecConfig,
                 prefetch: PrefetchSink | None = None, cutoff: int | None = None,
                 stats: SpecStats | None = None) -> None:
        """prefetch: where predicted experts go (None: no cross-model prefetch);
        cutoff: leading target MoE layers to prefetch for (None: all)."""
        target_config: ModelConfig = target.model.config
        draft_config: ModelConfig = draft.model.config
        check_draft(target_config, draft_config)
        predictor = None
        if prefetch is not None and target_config.is_moe and cutoff != 0:  # cutoff 0: plain SD
            predictor = _cross_model_predictor(target, draft_config, prefetch, cutoff)
        hook = None if predictor is None else predictor.on_draft_attention
        super().__init__(target, Drafter(draft, on_attention_output=hook), config, predictor, stats)


def _cross_model_predictor(target: BoundModel, draft: ModelConfig, prefetch: PrefetchSink,
                           cutoff: int | None) -> CrossModelPredictor | None:
    target_config: ModelConfig = target.model.config
    if draft.hidden_size != target_config.hidden_size:
        log.warning("cross-model expert prediction off: draft hidden size %d != target %d; "
                    "only the next-layer predictor prefetches", draft.hidden_size, target_config.hidden_size)
        return None
    mapping = layer_map(draft.num_layers, target_config.num_layers, target_config.moe_layers, cutoff)
    return CrossModelPredictor(target.model, mapping, prefetch)
