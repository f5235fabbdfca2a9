"""One request's generation state inside the engine (plain Python, no torch: the scheduler is tested without it).

A Sequence owns its progress: `num_computed_tokens` says how many of all_ids have their keys and
values in the KV cache, `block_table` which KV blocks hold them. Nothing infers either from the cache.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING

from moe_serve.engine.messages import GenerateRequest, SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from moe_serve.engine.structured import GrammarMatcher


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    # seeds every random draw of this request: the request's own seed, else one picked at arrival,
    # so a request samples the same tokens alone or in any batch (moe_serve/engine/sampler.py)
    seed: int
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_counts: Counter[int] = field(default_factory=Counter)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # [i]: of prompt token i + 1, when asked
    first_token_time: float | None = None
    finish_reason: str | None = None
    emitted: int = 0  # output tokens already sent to the client
    emitted_prompt_logprobs: int = 0  # prompt_logprobs already sent
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # all_ids[:num_computed_tokens] have their KV in block_table's blocks
    # all_ids[:num_draft_computed_tokens] have their KV in the draft model's paged cache, same blocks
    # (batched speculation with --spec draft: moe_serve/engine/speculative/batched.py)
    num_draft_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    grammar: GrammarMatcher | None = None  # where its constrained output stands (params.structured)
    # the draws outside the batched sampler (sampling.sequence_generator: seeded from `seed` on first use)
    generator: object | None = None

    @classmethod
    def from_request(cls, request: GenerateRequest) -> "Sequence":
        seed = request.params.seed if request.params.seed is not None else random.getrandbits(63)
        return cls(request.request_id, list(request.prompt_ids), request.params, seed)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens the next forwards must feed: the prompt (or its rest) at first, then the last sampled token."""
        return self.num_tokens - self.num_computed_tokens

    def unscored_prompt_positions(self, start: int, end: int) -> range:
        """The positions in [start, end) whose logits score a prompt token not scored yet: position p
        scores prompt token p + 1. Empty unless asked, and after a preemption (its recompute finds
        every token scored), so no prompt logprob is computed or sent twice."""
        if self.params.prompt_logprobs is None:
            return range(0)
        return range(max(start, len(self.prompt_logprobs)), min(end, len(self.prompt_ids) - 1))

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: TokenLogprob | None, max_model_len: int) -> bool:
        """Add one generated token; returns True once the sequence is finished."""
        if self.params.max_tokens == 0:  # an echo of the prompt alone: the prefill was for its logprobs
            self.finish_reason = "length"
            return True
        grammar, position = self.grammar, len(self.output_ids)
        if grammar is not None and grammar.complete_within(position):
            # complete at the last token, which the batched runner consumed after this token was
            # sampled (the mask allowed only EOS): the sequence ends as it would have there
            self.finish_reason = "stop"
            return True
        self.output_ids.append(token)
        self.output_counts[token] += 1
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif self.remaining <= 0 or self.num_tokens >= max_model_len:
            if grammar is not None:  # complete at this very token: that ending is "stop"
                grammar.settle()
            self.finish_reason = "stop" if grammar is not None and grammar.complete_within(position + 1) else "length"
        return self.finish_reason is not None
