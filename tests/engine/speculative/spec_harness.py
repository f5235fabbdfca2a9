"""Tiny models, cached runners and a generate loop shared by the speculative-decoding tests."""
from __future__ import annotations

from pathlib import Path

import torch

from moe_serve.engine.decode import BoundModel, Decoder
from moe_serve.engine.experts.runner import CachedExpertRunner
from moe_serve.engine.experts.store import ExpertStore
from moe_serve.engine.graphs import GraphedDecode
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.loader import load_model
from moe_serve.engine.messages import SamplingParams
from moe_serve.engine.models.blocks import CausalLM
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.sequence import Sequence
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.draft_spec import DraftSpecDecoder
from moe_serve.engine.speculative.self_spec import SelfSpecDecoder

MAX_LEN = 64
CPU = torch.device("cpu")


def load_cached(path: Path, device: torch.device = CPU, all_resident: bool = False) -> CausalLM:
    """An MoE tiny model whose expert cache holds only top_k + 1 experts in all (or every expert),
    under next-use, the policy the engine picks for speculative decoding."""
    def runner(store: ExpertStore, config: ModelConfig) -> CachedExpertRunner:
        budget = None if all_resident else (config.top_k + 1) * store.layout.nbytes
        return CachedExpertRunner(store, budget, "next-use", device, top_k=config.top_k)

    return load_model(path, device, torch.float32, runner_factory=runner, progress=False).model


def load_dense(path: Path, device: torch.device = CPU) -> CausalLM:
    return load_model(path, device, torch.float32, progress=False).model


def new_kv(model: CausalLM) -> KVCache:
    return KVCache.for_model(model.config, MAX_LEN, device=model.device, dtype=model.dtype)


def bind(model: CausalLM, graphs: bool = False) -> BoundModel:
    """graphs: one-token forwards replay CUDA graphs, as the runtime sets up when nothing needs the host."""
    kv = new_kv(model)
    return BoundModel(model, kv, model.device, graphs=GraphedDecode(model, kv) if graphs else None)


def prefill_kv(model: CausalLM, ids: list[int]) -> KVCache:
    """A fresh cache holding ids, computed in one forward with every expert."""
    kv = new_kv(model)
    model(torch.tensor(ids, device=model.device), 0, kv)
    return kv


def generate(decoder: Decoder, target: BoundModel, prompt: list[int], params: SamplingParams,
             max_model_len: int = MAX_LEN) -> Sequence:
    """Run decoder to completion, checking the KV invariant after every step."""
    seq = Sequence("test", list(prompt), params, seed=0 if params.seed is None else params.seed)
    decoder.reset()
    while seq.finish_reason is None:
        before = len(seq.output_ids)
        decoder.step(seq, max_model_len)
        assert len(seq.output_ids) > before, "a step must emit at least one token"
        assert target.kv.length == len(seq.all_ids) - 1, "the target KV must hold all tokens but the pending one"
    return seq


def generate_with_prefetch(target: CausalLM, draft: CausalLM | None, prompt: list[int],
                           params: SamplingParams) -> tuple[Sequence, BoundModel, int]:
    """Speculative decoding (self-draft when draft is None) whose expert predictions are prefetched
    into the target's own cache; returns the sequence, the bound target and the bytes prefetched."""
    cache = target.runner.cache
    bound = bind(target)
    decoder = (SelfSpecDecoder(bound, SpecConfig(gamma=3), prefetch=cache) if draft is None
               else DraftSpecDecoder(bound, bind(draft), SpecConfig(gamma=3), prefetch=cache))
    before = cache.stats.snapshot().total().prefetch_bytes
    seq = generate(decoder, bound, prompt, params)
    return seq, bound, cache.stats.snapshot().total().prefetch_bytes - before


def assert_kv_matches_prefill(target: BoundModel, ids: list[int]) -> None:
    fresh = prefill_kv(target.model, ids)
    n = len(ids)
    assert target.kv.length == n
    torch.testing.assert_close(target.kv.keys[:, :n], fresh.keys[:, :n], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(target.kv.values[:, :n], fresh.values[:, :n], rtol=1e-4, atol=1e-5)


class RecordingSink:
    """Prefetch sink that remembers what it was asked to load: per call, (layer, experts) per layer."""

    def __init__(self) -> None:
        self.tasks: list[tuple[int, list[int]]] = []

    def prefetch(self, keys: list[tuple[int, int]]) -> None:
        by_layer: dict[int, list[int]] = {}
        for layer, expert in keys:
            by_layer.setdefault(layer, []).append(expert)
        self.tasks.extend(by_layer.items())
