"""Plain autoregressive decoding of one sequence: feed what the KV cache lacks, sample one token."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from moe_serve.engine.graphs import GraphedDecode
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.messages import TokenLogprob
from moe_serve.engine.sampling import (apply_penalties, draw, forbid_stop_tokens, sequence_generator, target_distribution,
                             token_logprob)
from moe_serve.engine.sequence import Sequence

# what a graph replay can honour; an on_attention_output hook is captured with the forward, so it
# must only do device work (the speculative expert predictor is written that way)
_GRAPHABLE_KWARGS = {"last_only", "moe_top_r", "on_attention_output"}


class PendingLogits:
    """fp32 logits [T, V] on their way to the host: on CUDA a copy into pinned memory queued behind
    the forward; result() waits for it. (A replayed graph's logits buffer is overwritten by the
    next replay, so the copy is queued before anything else can launch.)"""

    def __init__(self, logits: torch.Tensor) -> None:
        self._ready: torch.cuda.Event | None = None
        if logits.is_cuda:
            self._host = torch.empty(logits.shape, dtype=torch.float32, pin_memory=True)  # [T, V]
            self._host.copy_(logits.float(), non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = logits.float()

    def result(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


class BoundModel:
    """A model bound to one KV cache: forward() continues from wherever the cache ends."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, device: torch.device,
                 on_forward: Callable[[range], None] | None = None, graphs: GraphedDecode | None = None) -> None:
        self.model, self.kv, self.device = model, kv, device
        self.on_forward = on_forward  # told the positions of each forward's tokens (routing traces)
        self.graphs = graphs  # short forwards (decode, draft, verify) replay CUDA graphs when set

    def forward(self, ids: list[int], **model_kwargs) -> torch.Tensor:
        """Run ids at positions kv.length.. and return fp32 logits [T, V] on the CPU."""
        return self.launch(ids, **model_kwargs).result()

    def launch(self, ids: list[int], **model_kwargs) -> PendingLogits:
        """forward() without the wait: the device computes while the host goes on (a drafting loop
        hands predicted experts to the cache meanwhile). Read the result before the next launch."""
        start = self.kv.length
        if self.on_forward is not None:
            self.on_forward(range(start, start + len(ids)))
        if self.graphs is not None and set(model_kwargs) <= _GRAPHABLE_KWARGS and self.graphs.accepts(len(ids)):
            logits = self.graphs.forward(ids, model_kwargs.get("moe_top_r"), model_kwargs.get("on_attention_output"))
            return PendingLogits(logits[-1:] if model_kwargs.get("last_only") else logits)
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)  # [T]
        return PendingLogits(self.model(input_ids, start, self.kv, **model_kwargs))

    def reset(self) -> None:
        self.kv.reset()


def choose_token(seq: Sequence, logits: torch.Tensor, generator: torch.Generator) -> tuple[int, TokenLogprob | None]:
    """Sample (or argmax) the next token of seq from one position's logits [V]."""
    logits = apply_penalties(logits, seq.params, seq.output_counts, seq.prompt_ids)
    logits = forbid_stop_tokens(logits, seq.params, len(seq.output_ids))
    if seq.params.temperature == 0:  # the argmax of the one-hot target_distribution, without building it
        token = int(logits.argmax())
    else:
        token = draw(target_distribution(logits, seq.params), generator)
    logprob = None if seq.params.logprobs is None else token_logprob(logits, token, seq.params.logprobs)
    return token, logprob


class Decoder(Protocol):
    def step(self, seq: Sequence, max_model_len: int) -> None:
        """Append at least one token to seq (stopping early once it finishes)."""
        ...

    def reset(self) -> None:
        """Forget the previous sequence (new request)."""
        ...


class PlainDecoder:
    """One sequence at a time over a BoundModel (speculative decoding's prefill, references in tests
    and benchmarks); the engine's own plain decoding is batched (moe_serve/engine/model_runner.py)."""

    def __init__(self, target: BoundModel) -> None:
        self.target = target

    def step(self, seq: Sequence, max_model_len: int) -> None:
        pending = seq.all_ids[self.target.kv.length :]  # prompt on the first step, else the last token
        logits = self.target.forward(pending, last_only=True)[-1]  # [V]
        token, logprob = choose_token(seq, logits, sequence_generator(seq))
        seq.append(token, logprob, max_model_len)

    def reset(self) -> None:
        self.target.reset()
