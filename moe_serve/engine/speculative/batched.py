"""Draft/verify for a batch: the decoding sequences of a step draft together, one batched forward
per drafted position, and ONE batched target forward over the paged KV cache verifies them all,
so the verify pass's tokens of every sequence share each expert copy.

The rounds are loop.py's (draft up to gamma tokens, verify pending + drafts, keep or correct each
position, a bonus token after all kept), over the scheduler's KV blocks instead of one contiguous
cache. Who drafts:
* --spec self: the target itself at top-r experts, writing its own paged cache at the drafted
  positions, which the verify pass then rewrites with all k;
* --spec draft: the draft model over a paged cache of its own with the same blocks (a sequence's
  block table addresses both models' keys and values). `num_draft_computed_tokens` says how far
  the draft has caught up; a round first feeds it what it has not seen (the prompt, tokens the
  target decoded plainly meanwhile) in the forward of its first drafted position.

A step's prefill chunks (new prompts, or their next pieces) ride along in the verify forward,
sampled and scored as in a plain step, so arrivals do not stop the others' speculation.

KV after a round: the target holds all_ids[:-1] (num_computed_tokens), the draft the fed positions
that hold committed tokens. A round changes no sequence until `accept`, so when `draft_and_verify`
fails the engine can still decode the step plainly, each request on its own.

The lone-sequence decoder (loop.py) also prefetches the verify pass's experts from the draft's
predictions and adapts gamma; a batch verifies B x (gamma + 1) tokens, which at Mixtral-size
experts route to nearly every expert of a layer, so the expert runner's own layer-ahead copies are
what overlaps them here.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

import torch

from moe_serve.engine.decode import PendingLogits
from moe_serve.engine.model_runner import ChunkResult, Feed, ModelRunner
from moe_serve.engine.sampling import apply_penalties, sequence_generator
from moe_serve.engine.scheduler import ScheduledChunk
from moe_serve.engine.sequence import Sequence
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.loop import Drafted, accept, draft_budget, drafting_stops, propose
from moe_serve.engine.speculative.stats import SpecStats


@dataclass(frozen=True)
class VerifiedRound:
    seqs: list[Sequence]
    drafts: list[list[Drafted]]  # per sequence
    draft_fed: list[int]  # per sequence: positions the draft model's cache holds after drafting
    logits: torch.Tensor  # [sum(len(drafts) + 1), V] the target's, pending + drafts of each sequence in turn
    draft_seconds: float
    verify_seconds: float


class BatchedSpeculator:
    def __init__(self, target: ModelRunner, draft: ModelRunner | None, config: SpecConfig, stats: SpecStats) -> None:
        """draft: the draft model's runner over its own paged cache; None to self-draft at config.top_r."""
        self.target, self.draft, self.config, self.stats = target, draft, config, stats

    def positions_needed(self, seq: Sequence, max_model_len: int) -> int:
        """KV positions a round may write for seq (pending + its drafts): blocks to reserve first."""
        return seq.num_tokens + draft_budget(seq, self.config.gamma, max_model_len)

    def draft_and_verify(self, seqs: list[Sequence], max_model_len: int, chunks: list[ScheduledChunk] | None = None,
                         ) -> tuple[VerifiedRound, list[ChunkResult]]:
        """The round of seqs, and the results of the step's other chunks (prefills), whose tokens
        the verify forward runs too, as a plain step would (ModelRunner.execute)."""
        started = time.perf_counter()
        drafts, fed = self._draft(seqs, [draft_budget(s, self.config.gamma, max_model_len) for s in seqs])
        drafted = time.perf_counter()
        feeds = [Feed(s.block_table, s.num_computed_tokens, s.all_ids[s.num_computed_tokens:] + [d.token for d in ds])
                 for s, ds in zip(seqs, drafts)]
        results, logits = self.target.execute(chunks or [], verify=feeds)  # logits [tokens, V] on the host
        return (VerifiedRound(seqs, drafts, fed, logits, drafted - started, time.perf_counter() - drafted),
                results)

    def accept(self, verified: VerifiedRound, max_model_len: int) -> None:
        """Emit each sequence's kept drafts and its correction or bonus token; roll the caches' progress back."""
        offset, share = 0, 1.0 / len(verified.seqs)
        for seq, drafts, fed in zip(verified.seqs, verified.drafts, verified.draft_fed):
            rows = verified.logits[offset : offset + len(drafts) + 1]  # [n+1, V]
            offset += len(drafts) + 1
            kept = accept(seq, drafts, rows, self.config, sequence_generator(seq), max_model_len)
            seq.num_computed_tokens = seq.num_tokens - 1
            if self.draft is not None:
                seq.num_draft_computed_tokens = min(fed, seq.num_tokens - 1)
            self.stats.record_verify(len(drafts), kept, verified.draft_seconds * share, verified.verify_seconds * share)

    def _draft(self, seqs: list[Sequence], budgets: list[int]) -> tuple[list[list[Drafted]], list[int]]:
        """Each sequence's drafts (up to its budget; fewer after a stop token or an unsure draft) and
        how many positions the drafting cache then holds for it."""
        drafts: list[list[Drafted]] = [[] for _ in seqs]
        counts = [Counter(s.output_counts) for s in seqs]
        fed = [s.num_draft_computed_tokens if self.draft is not None else s.num_computed_tokens for s in seqs]
        active = [i for i, budget in enumerate(budgets) if budget > 0]
        runner, top_r = (self.draft, None) if self.draft is not None else (self.target, self.config.top_r)
        while active:
            feeds = [Feed(seqs[i].block_table, fed[i], (seqs[i].all_ids + [d.token for d in drafts[i]])[fed[i]:])
                     for i in active]
            ends = list(accumulate(len(f.token_ids) for f in feeds))
            logits = PendingLogits(runner.logits(feeds, [end - 1 for end in ends], top_r)).result()  # [A, V]
            still = []
            for row, (i, feed) in enumerate(zip(active, feeds)):
                seq = seqs[i]
                fed[i] += len(feed.token_ids)
                penalised = apply_penalties(logits[row], seq.params, counts[i])  # [V]
                drafts[i].append(propose(seq, penalised, sequence_generator(seq)))
                counts[i][drafts[i][-1].token] += 1
                if not (len(drafts[i]) == budgets[i]
                        or drafting_stops(seq, drafts[i][-1].token, penalised, self.config.confidence)):
                    still.append(i)
            active = still
        return drafts, fed
