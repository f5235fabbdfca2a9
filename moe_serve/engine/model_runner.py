"""ModelRunner: one scheduled step on the device: every chunk's tokens in one forward, one batched sample.

The scheduler decides which tokens of which sequences; this turns them into the forward's flat
token ids, positions and KV slots (moe_serve/engine/kv/paged_cache.py), keeps the logits of only the
rows that sample, and samples them all at once (moe_serve/engine/sampler.py) under the grammar masks
(moe_serve/engine/structured.py), which fill on the host beside the step's own host work.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from moe_serve.engine.decode import PendingLogits
from moe_serve.engine.graphs import GraphedBatchStep
from moe_serve.engine.kv.paged_cache import PagedKVCache, PagedStep, StepLayout
from moe_serve.engine.messages import TokenLogprob
from moe_serve.engine.models.blocks import CausalLM
from moe_serve.engine.prompt_logprobs import score_prompt_tokens
from moe_serve.engine.sampler import SamplingBatch, SamplingRow, sample
from moe_serve.engine.scheduler import ScheduledChunk
from moe_serve.engine.structured import MaskFiller, PendingMasks


@dataclass(frozen=True)
class Sampled:
    token: int
    logprob: TokenLogprob | None


@dataclass(frozen=True)
class Feed:
    """What one sequence feeds a forward: token_ids at positions start.. over its KV blocks."""

    block_table: list[int]
    start: int
    token_ids: list[int]


@dataclass(frozen=True)
class ChunkResult:
    sampled: Sampled | None  # the token after the chunk; None for a prefill chunk short of its prompt's end
    prompt_logprobs: list[TokenLogprob]  # of the prompt tokens its positions score (moe_serve/engine/prompt_logprobs.py)


class ModelRunner:
    def __init__(self, model: CausalLM, cache: PagedKVCache, max_model_len: int,
                 on_forward: Callable[[Sequence[int]], None] | None = None,
                 graphs: GraphedBatchStep | None = None) -> None:
        self.model, self.cache, self.max_model_len = model, cache, max_model_len
        self.device = model.device
        self.on_forward = on_forward  # told the positions of each forward's tokens (routing traces)
        self.graphs = graphs  # steps of decodes and short prefill chunks replay CUDA graphs when set
        self.masks = MaskFiller()  # the grammar masks, filled while the device runs each forward (engine/structured.py)

    def execute(self, chunks: list[ScheduledChunk], verify: list[Feed] | None = None,
                ) -> tuple[list[ChunkResult], torch.Tensor | None]:
        """Run chunks' tokens; per chunk, the token sampled after it and the prompt logprobs it scored.
        verify: feeds whose every token's logits are wanted too (a speculative round's verify pass,
        moe_serve/engine/speculative/batched.py), run in the same forward; their logits [E, V] come
        back on the host, else None."""
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        scored = [c.seq.unscored_prompt_positions(c.start, c.start + c.num_tokens) for c in chunks]
        masks = self.masks.pending([chunks[i].seq.grammar for i in sampling], self.device)
        logits, verified = self._forward(chunks, sampling, scored, verify or [])  # [S + P, V], [E, V] pending
        prompt_logprobs = self._score_prompts(chunks, scored, logits[len(sampling):]) if any(scored) else {}
        sampled = self._sample(chunks, sampling, logits[:len(sampling)], masks) if sampling else {}
        results = [ChunkResult(sampled.get(i), prompt_logprobs.get(i, [])) for i in range(len(chunks))]
        return results, None if verified is None else verified.result()

    def _forward(self, chunks: list[ScheduledChunk], sampling: list[int], scored: list[range],
                 verify: list[Feed]) -> tuple[torch.Tensor, PendingLogits | None]:
        """The logits [S + P, V] of each sampling chunk's last token, then of the scored prompt
        positions; and those of every verify token [E, V], on their way to the host."""
        offsets = list(accumulate((c.num_tokens for c in chunks), initial=0))  # [C + 1] each chunk's first row
        score_rows = [offsets[i] + p - c.start for i, c in enumerate(chunks) for p in scored[i]]
        rows = [offsets[i + 1] - 1 for i in sampling] + score_rows
        verify_rows = list(range(offsets[-1], offsets[-1] + sum(len(f.token_ids) for f in verify)))
        feeds = [Feed(c.seq.block_table, c.start, c.token_ids) for c in chunks] + verify
        logits = self.logits(feeds, rows + verify_rows, replay=not score_rows)  # [S + P + E, V]
        # the verify rows' copy to the host is queued before the sampler's ops
        return logits[:len(rows)], PendingLogits(logits[len(rows):]) if verify else None

    def logits(self, feeds: list[Feed], rows: list[int], moe_top_r: int | None = None,
               replay: bool = True) -> torch.Tensor:
        """One forward of every feed's tokens; the logits [R, V] of the flat token rows `rows`. On
        CUDA they are still being computed: nothing here waits for the device. A step of short
        feeds replays a CUDA graph when `replay` (speculative decoding's drafts and verify too)."""
        ids = [t for f in feeds for t in f.token_ids]
        layout = StepLayout.of([(f.block_table, f.start, len(f.token_ids)) for f in feeds], self.cache.block_size)
        if self.on_forward is not None:
            self.on_forward(layout.positions)
        if replay and rows and self.graphs is not None and self.graphs.accepts([len(f.token_ids) for f in feeds]):
            return self.graphs.forward(ids, layout, rows, self.max_model_len, moe_top_r)  # [R, V]
        paged = PagedStep.build(self.cache, layout, self.device)
        logit_rows = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)  # [R]
        input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)  # [T]
        return self.model.forward_batch(input_ids, paged, [(f.start, len(f.token_ids)) for f in feeds],
                                        logit_rows, moe_top_r)  # [R, V]

    def _sample(self, chunks: list[ScheduledChunk], sampling: list[int], logits: torch.Tensor,
                masks: PendingMasks | None) -> dict[int, Sampled]:
        """Chunk index -> the token sampled after it, from the sampling chunks' logits [S, V]."""
        batch = SamplingBatch.build([SamplingRow(chunks[i].seq.params, chunks[i].seq.seed, chunks[i].seq.output_ids,
                                                 chunks[i].seq.prompt_ids) for i in sampling], self.device)
        # the masks are waited for inside, as late as they can be
        tokens, logprobs = sample(logits.float(), batch, None if masks is None else masks.result).to_host()
        if masks is not None:  # the grammar process consumes them, then fills the next step's masks meanwhile
            self.masks.follow(masks, tokens)
        return {i: Sampled(token, logprob) for i, token, logprob in zip(sampling, tokens, logprobs)}

    @staticmethod
    def _score_prompts(chunks: list[ScheduledChunk], scored: list[range],
                       logits: torch.Tensor) -> dict[int, list[TokenLogprob]]:
        """Chunk index -> the prompt logprobs of its scored positions; logits [P, V] in that order."""
        targets = [c.seq.prompt_ids[p + 1] for c, positions in zip(chunks, scored) for p in positions]
        tops = [c.seq.params.prompt_logprobs or 0 for c, positions in zip(chunks, scored) for _ in positions]
        flat = score_prompt_tokens(logits, targets, tops)
        starts = list(accumulate(map(len, scored), initial=0))
        return {i: flat[starts[i]:starts[i + 1]] for i, positions in enumerate(scored) if positions}
