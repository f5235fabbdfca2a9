"""ModelRunner: one scheduled step on the device: every chunk's tokens in one forward, one batched sample.

The scheduler decides which tokens of which sequences; this turns them into the forward's flat
token ids, positions and KV slots (engine/kv/paged_cache.py), keeps the logits of only the
rows that sample, and samples them all at once (engine/sampler.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.graphs import GraphedBatchDecode
from engine.kv.paged_cache import PagedKVCache, PagedStep, StepLayout
from engine.messages import TokenLogprob
from engine.models.blocks import CausalLM
from engine.sampler import SamplingBatch, SamplingRow, sample
from engine.scheduler import ScheduledChunk


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: TokenLogprob | None


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedKVCache, max_model_len: int,
                 on_forward: Callable[[Sequence[int]], None] | None = None,
                 graphs: GraphedBatchDecode | None = None) -> None:
        self.model, self.cache, self.max_model_len = model, cache, max_model_len
        self.device = model.device
        self.on_forward = on_forward  # told the positions of each forward's tokens (routing traces)
        self.graphs = graphs  # decode-only steps replay CUDA graphs when set

    def execute(self, chunks: list[ScheduledChunk]) -> list[Sampled | None]:
        """Run chunks' tokens; per chunk, the token sampled after it (None for a prefill chunk that
        has not reached its prompt's end)."""
        ids = [t for c in chunks for t in c.token_ids]
        layout = StepLayout.of([(c.seq.block_table, c.start, c.num_tokens) for c in chunks], self.cache.block_size)
        if self.on_forward is not None:
            self.on_forward(layout.positions)
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        if self.graphs is not None and len(sampling) == len(ids) and self.graphs.accepts(len(ids)):
            logits = self.graphs.forward(ids, layout, self.max_model_len)  # [R, V]: decodes only
        else:
            logits = self._forward_eagerly(chunks, ids, layout, sampling)  # [R, V]
        results: list[Sampled | None] = [None] * len(chunks)
        if sampling:
            batch = SamplingBatch.build([SamplingRow(chunks[i].seq.params, chunks[i].seq.seed,
                                                     chunks[i].seq.output_ids) for i in sampling], self.device)
            tokens, logprobs = sample(logits.float(), batch).to_host()
            for i, token, logprob in zip(sampling, tokens, logprobs):
                results[i] = Sampled(token, logprob)
        return results

    def _forward_eagerly(self, chunks: list[ScheduledChunk], ids: list[int], layout: StepLayout,
                         sampling: list[int]) -> torch.Tensor:
        paged = PagedStep.build(self.cache, layout, self.device)
        ends = torch.tensor([c.num_tokens for c in chunks]).cumsum(0) - 1  # [C] each chunk's last row
        rows = ends[sampling].to(self.device, non_blocking=True)  # [R]
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)  # [T]
        return self.model.forward_batch(input_ids, paged, [(c.start, c.num_tokens) for c in chunks], rows)  # [R, V]
