"""The one draft -> verify -> accept loop that every speculative mode runs.

KV invariant between steps: the target's cache holds exactly all_ids[:-1]; the last emitted token
is pending and is the first token the next verify pass feeds. One step:

  1. draft up to gamma tokens (fewer near max_tokens or the context end, after a stop token, or
     once the draft's confidence drops below tau), each from the draft's logits penalised with
     the running counts;
  2. roll the target back to all_ids[:-1] (a self-draft wrote its own cache) and verify pending
     + drafts in ONE target forward, which rewrites those positions with the full model;
  3. walk the positions: keep or correct each draft (acceptance.py), appending token by token so
     penalties see the counts of the tokens before them; after all kept, the last row gives the
     bonus token; stop the moment seq.append reports the sequence finished;
  4. truncate target and draft caches to all_ids[:-1].

The very first step of a sequence is the prefill: its own forward and one plainly sampled token.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch

from moe_serve.engine.decode import BoundModel, PendingLogits, PlainDecoder, choose_token
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.sampling import apply_penalties, draw, sequence_generator, target_distribution, token_logprob
from moe_serve.engine.sequence import Sequence
from moe_serve.engine.speculative.acceptance import AcceptRule, verify_position
from moe_serve.engine.speculative.adaptive import AdaptiveGamma, AdaptiveGammaConfig
from moe_serve.engine.speculative.config import SpecConfig
from moe_serve.engine.speculative.cross_model import CrossModelPredictor
from moe_serve.engine.speculative.stats import SpecStats


@dataclass(frozen=True)
class Drafted:
    token: int
    # [V] the distribution the token was drawn from (after penalties, temperature, top-k/p); None
    # when greedy, where acceptance compares argmaxes
    q: torch.Tensor | None


def draft_budget(seq: Sequence, gamma: int, max_model_len: int) -> int:
    """Drafts such that drafts + bonus fit both max_tokens and the context."""
    return max(0, min(gamma, seq.remaining - 1, max_model_len - seq.num_tokens - 1))


def propose(seq: Sequence, logits: torch.Tensor, generator: torch.Generator) -> Drafted:
    """The draft's next token from its logits [V], already penalised with the running counts."""
    q = None if seq.params.temperature == 0 else target_distribution(logits, seq.params)  # [V]
    return Drafted(int(logits.argmax()) if q is None else draw(q, generator), q)


def drafting_stops(seq: Sequence, token: int, logits: torch.Tensor, confidence: float) -> bool:
    """After a stop token, or once the draft's own max probability (softmax of the penalised logits
    [V] it drew from) is below tau."""
    if token in seq.params.stop_token_ids:
        return True
    return confidence > 0 and float(torch.softmax(logits, -1).max()) < confidence


def accept(seq: Sequence, drafts: list[Drafted], logits: torch.Tensor, config: SpecConfig,
           generator: torch.Generator, max_model_len: int) -> int:
    """Emit kept drafts, then a correction or the bonus token, from the target's logits [n+1, V]
    over pending + drafts, under config's acceptance rule; returns how many drafts were kept."""
    rule = AcceptRule(seq.params.temperature == 0, config.confidence, config.adaptive_tolerance)
    for i, draft in enumerate(drafts):
        row = apply_penalties(logits[i], seq.params, seq.output_counts)  # [V] counts include kept drafts
        p = row if rule.greedy else target_distribution(row, seq.params)  # greedy needs only the argmax
        token, kept = verify_position(p, draft.q, draft.token, rule, generator)
        logprob = None if seq.params.logprobs is None else token_logprob(row, token, seq.params.logprobs)
        if seq.append(token, logprob, max_model_len) or not kept:
            return i + int(kept)
    token, logprob = choose_token(seq, logits[len(drafts)], generator)
    seq.append(token, logprob, max_model_len)
    return len(drafts)


class Drafter:
    """A model proposing the next tokens from its own KV cache (the target's own when self-drafting)."""

    def __init__(self, model: BoundModel, **forward_kwargs) -> None:
        self.model = model
        # unset options stay out of every call (and of BoundModel's CUDA-graph keys)
        self.forward_kwargs = {k: v for k, v in forward_kwargs.items() if v is not None}

    @property
    def kv(self) -> KVCache:
        return self.model.kv

    def launch(self, ids: list[int]) -> PendingLogits:
        """Start computing the logits of the token after ids, feeding only the ids this drafter's cache lacks."""
        return self.model.launch(ids[self.kv.length :], last_only=True, **self.forward_kwargs)

    def next_logits(self, ids: list[int]) -> torch.Tensor:
        """Logits [V] of the token after ids."""
        return self.launch(ids).result()[-1]


class SpecDecoder:
    def __init__(self, target: BoundModel, drafter: Drafter, config: SpecConfig,
                 predictor: CrossModelPredictor | None = None, stats: SpecStats | None = None) -> None:
        self.target, self.drafter, self.config, self.predictor = target, drafter, config, predictor
        self.stats = SpecStats() if stats is None else stats
        self.prefill = PlainDecoder(target)
        self.adaptive = AdaptiveGamma(AdaptiveGammaConfig(config.gamma)) if config.adaptive_gamma else None

    def step(self, seq: Sequence, max_model_len: int) -> None:
        if not seq.output_ids:
            self.prefill.step(seq, max_model_len)
            return
        started = time.perf_counter()
        drafts = self._draft(seq, self._draft_budget(seq, max_model_len))
        drafted = time.perf_counter()
        logits = self._verify(seq, drafts)  # [n+1, V]
        verified = time.perf_counter()
        kept = self._accept(seq, drafts, logits, max_model_len)
        self._rollback(len(seq.all_ids) - 1)
        self._record(len(drafts), kept, drafted - started, verified - drafted)

    def reset(self) -> None:
        self.target.reset()
        self.drafter.model.reset()
        if self.adaptive is not None:
            self.adaptive.reset()
        if self.predictor is not None:
            self.predictor.reset()

    def _draft_budget(self, seq: Sequence, max_model_len: int) -> int:
        return draft_budget(seq, self.config.gamma if self.adaptive is None else self.adaptive.gamma, max_model_len)

    def _draft(self, seq: Sequence, budget: int) -> list[Drafted]:
        """Each drafted token's predicted experts go to the cache while the next one computes: the
        host's hand-over then costs no drafting time."""
        ids, counts, drafts = seq.all_ids, Counter(seq.output_counts), []
        pending = self._launch_draft(ids) if budget > 0 else None
        while pending is not None:
            logits = apply_penalties(pending.result()[-1], seq.params, counts)  # [V]
            predicted = None if self.predictor is None else self.predictor.predictions()
            drafts.append(propose(seq, logits, sequence_generator(seq)))
            ids = ids + [drafts[-1].token]
            counts[drafts[-1].token] += 1  # the next draft position sees this token's penalty, as verify will
            done = len(drafts) == budget or drafting_stops(seq, drafts[-1].token, logits, self.config.confidence)
            pending = None if done else self._launch_draft(ids)
            if predicted is not None:
                self.predictor.prefetch(predicted)
        return drafts

    def _launch_draft(self, ids: list[int]) -> PendingLogits:
        pending = self.drafter.launch(ids)
        if self.predictor is not None:
            self.predictor.collect()
        return pending

    def _verify(self, seq: Sequence, drafts: list[Drafted]) -> torch.Tensor:
        self._truncate(self.target.kv, len(seq.all_ids) - 1)  # drop what a self-draft wrote
        ids = [seq.all_ids[-1]] + [d.token for d in drafts]
        if self.predictor is None:
            return self.target.forward(ids)
        with self.predictor.verifying():
            return self.target.forward(ids)

    def _accept(self, seq: Sequence, drafts: list[Drafted], logits: torch.Tensor, max_model_len: int) -> int:
        return accept(seq, drafts, logits, self.config, sequence_generator(seq), max_model_len)

    def _rollback(self, length: int) -> None:
        self._truncate(self.target.kv, length)
        self._truncate(self.drafter.kv, length)

    @staticmethod
    def _truncate(kv: KVCache, length: int) -> None:
        kv.truncate(min(kv.length, length))

    def _record(self, drafted: int, kept: int, draft_seconds: float, verify_seconds: float) -> None:
        self.stats.record_verify(drafted, kept, draft_seconds, verify_seconds)
        if self.adaptive is not None:
            self.adaptive.update(drafted, kept, draft_seconds, verify_seconds)
        if self.predictor is not None:
            self.predictor.finish_round(self.stats)
