"""Turning one position's logits into a token: penalties, temperature, top-k, top-p, seeded draws.

Everything here runs on the CPU in fp32 on a single [V] row: the row has to reach the host
anyway to be emitted, and drawing on the CPU with a per-request torch.Generator makes a
seed give the same tokens on any device and under any concurrency.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from math import log

import torch

from moe_serve.engine.messages import SamplingParams, TokenLogprob


def apply_penalties(logits: torch.Tensor, params: SamplingParams, output_counts: Counter[int],
                    prompt_ids: Iterable[int] = ()) -> torch.Tensor:
    """logit_bias; vLLM's repetition penalty over prompt_ids and the tokens generated so far; then
    OpenAI presence/frequency penalties over the generated ones. logits [V].

    Draft/verify (moe_serve/engine/speculative/loop.py) passes no prompt_ids: the engine does not speculate
    for a sequence with a repetition penalty (moe_serve/engine/core.py)."""
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias)
        logits = logits.clone()
        logits[list(ids)] += torch.tensor(bias, dtype=logits.dtype)
    if params.repetition_penalty != 1.0:
        logits = _apply_repetition_penalty(logits, params.repetition_penalty, set(prompt_ids) | set(output_counts))
    if not output_counts or (params.presence_penalty == 0 and params.frequency_penalty == 0):
        return logits
    ids = torch.tensor(list(output_counts.keys()), dtype=torch.long)
    counts = torch.tensor(list(output_counts.values()), dtype=logits.dtype)
    out = logits.clone()
    out[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return out


def _apply_repetition_penalty(logits: torch.Tensor, penalty: float, seen: set[int]) -> torch.Tensor:
    """A seen token's logit divided by the penalty if positive, multiplied if not (vLLM, HF)."""
    if not seen:
        return logits
    ids = torch.tensor(sorted(seen), dtype=torch.long)
    values, scale = logits[ids], torch.tensor(penalty, dtype=logits.dtype)
    out = logits.clone()
    out[ids] = torch.where(values > 0, values / scale, values * scale)
    return out


def draft_verify_honours(params: SamplingParams, num_generated: int) -> bool:
    """Whether draft/verify (moe_serve/engine/speculative/loop.py) samples this sequence's next tokens as
    plain decoding would: it applies logit_bias, the OpenAI penalties and min_p, but neither the
    repetition penalty (it passes no prompt) nor min_tokens' mask; until those no longer apply,
    the engine decodes such a sequence in the batched step."""
    return params.repetition_penalty == 1.0 and num_generated >= params.min_tokens


def forbid_stop_tokens(logits: torch.Tensor, params: SamplingParams, num_generated: int) -> torch.Tensor:
    """The stop tokens (EOS, stop_token_ids) at -inf while fewer than min_tokens are generated. [V]."""
    if num_generated >= params.min_tokens or not params.stop_token_ids:
        return logits
    return logits.index_fill(0, torch.tensor(params.stop_token_ids, dtype=torch.long), float("-inf"))


def target_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from: temperature, then top-k, then top-p. [V] -> [V].

    Speculative sampling compares draft and target through this same function, so both sides
    are truncated identically. Temperature 0 gives a one-hot argmax.
    """
    if params.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.shape[-1]).to(torch.float32)
    # Shifted so the top logit is 0 first: a tiny temperature (1e-40 is valid) then sends the others
    # to -inf instead of everything to +-inf, whose softmax is NaN; and kept at least float32's
    # smallest normal, since 5e-324 would round to 0 and make 0 / 0.
    logits = logits.float()
    scaled = (logits - logits.max()) / max(params.temperature, torch.finfo(torch.float32).tiny)
    if params.min_p > 0:  # p_v < min_p * p_max, as scaled logits: the best one is 0
        scaled = scaled.masked_fill(scaled < torch.tensor(log(params.min_p)), float("-inf"))
    if 0 < params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs /= probs.sum()
    return probs


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """Log-probability of the chosen token under the model (before sampling transforms)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    alternatives: tuple[tuple[int, float], ...] = ()
    if top > 0:
        values, ids = torch.topk(logp, top)
        alternatives = tuple(zip(ids.tolist(), values.tolist()))
    return TokenLogprob(token_id=token, logprob=float(logp[token]), top=alternatives)


def sequence_generator(seq) -> torch.Generator:  # seq: engine.sequence.Sequence
    """The sequence's own CPU generator for the draws made outside the batched sampler (one-sequence
    decoding, speculation's drafts and accept/reject), seeded from seq.seed on first use."""
    if seq.generator is None:
        seq.generator = torch.Generator().manual_seed(seq.seed)
    return seq.generator


def make_generator(seed: int | None) -> torch.Generator:
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator
