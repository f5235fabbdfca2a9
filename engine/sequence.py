"""One request's generation state inside the engine (plain Python; no tensors but its RNG)."""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from engine.messages import GenerateRequest, SamplingParams, TokenLogprob
from engine.sampling import make_generator


@dataclass
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    arrival_time: float = field(default_factory=time.perf_counter)
    output_ids: list[int] = field(default_factory=list)
    output_counts: Counter[int] = field(default_factory=Counter)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_time: float | None = None
    finish_reason: str | None = None
    emitted: int = 0  # output tokens already sent to the client

    @classmethod
    def from_request(cls, request: GenerateRequest) -> "Sequence":
        return cls(request.request_id, list(request.prompt_ids), request.params, make_generator(request.params.seed))

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - len(self.output_ids)

    def append(self, token: int, logprob: TokenLogprob | None, max_model_len: int) -> bool:
        """Add one generated token; returns True once the sequence is finished."""
        self.output_ids.append(token)
        self.output_counts[token] += 1
        if logprob is not None:
            self.logprobs.append(logprob)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if token in self.params.stop_token_ids:
            self.finish_reason = "stop"
        elif self.remaining <= 0 or len(self.prompt_ids) + len(self.output_ids) >= max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None
