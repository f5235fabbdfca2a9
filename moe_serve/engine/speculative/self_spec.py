"""--spec self (SS-MoE): the target drafts with only its top-r experts per MoE layer, verifies with all k.

Drafting writes the target's own KV cache at the drafted positions with top-r activations; the
loop truncates them away before the verify pass recomputes those positions with the full top-k,
so the cache after a step equals a fresh prefill of the accepted text. Each drafted token runs
r of its top-k experts, resident ones first (the runner picks them: a draft only has to be
cheap, the verify pass decides what is kept). While drafting, the draft's router scores of each
layer name the top-k the verify pass will need; the ones not resident (the k - r extra, plus any
top-r expert the draft swapped for a resident one) are prefetched one drafted token later
(cross_model.py).
"""
from __future__ import annotations

from moe_serve.engine.decode import BoundModel
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.cross_model import CrossModelPredictor, PrefetchSink
from moe_serve.engine.speculative.layer_map import layer_map
from moe_serve.engine.speculative.loop import Drafter, SpecDecoder
from moe_serve.engine.speculative.stats import SpecStats


class SelfSpecDecoder(SpecDecoder):
    def __init__(self, target: BoundModel, config: SpecConfig, prefetch: PrefetchSink | None = None,
                 cutoff: int | None = None, stats: SpecStats | None = None) -> None:
        """prefetch: where the k - r extra experts go (None: no speculative prefetch);
        cutoff: leading MoE layers to prefetch for (None: all)."""
        model_config: ModelConfig = target.model.config
        if not model_config.is_moe:
            raise ValueError(f"--spec self needs an MoE model; {model_config.architecture} is dense")
        if config.top_r >= model_config.top_k:
            raise ValueError(f"--spec-top-r {config.top_r} must be below the model's top_k {model_config.top_k}: "
                             "a draft with every expert costs as much as the verify pass")
        predictor = None
        if prefetch is not None and cutoff != 0:  # cutoff 0: nothing to predict, so no hook at all
            depth = model_config.num_layers  # the draft is the target: the map is the identity
            predictor = CrossModelPredictor(target.model, layer_map(depth, depth, model_config.moe_layers, cutoff),
                                            prefetch)
        hook = None if predictor is None else predictor.on_draft_attention
        drafter = Drafter(target, moe_top_r=config.top_r, on_attention_output=hook)
        super().__init__(target, drafter, config, predictor, stats)
