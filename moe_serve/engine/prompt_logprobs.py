"""Prompt logprobs: each prompt token's log-probability under the positions before it, its rank and
the top alternatives, read off the prefill's own forward.

The model runner has the lm head score, beside the rows it samples, the rows of the prompt
positions that score a token for a sequence that asked (Sequence.unscored_prompt_positions), so
a prefill chunk costs one lm-head pass over its positions and a request that does not ask pays
nothing. These are the model's raw logprobs, as vLLM gives them: penalties, biases and
temperature shape what a request samples, and a prompt token is not sampled.
"""
from __future__ import annotations

import torch

from moe_serve.engine.messages import TokenLogprob
from moe_serve.engine.sampler import ranked_top_logprobs

# A [rows, V] slice in fp32 (and its int64 top-k keys) stays near 64 MiB (128 MiB), whatever the
# chunk length: a 2k-token chunk of a 150k vocabulary would be 1.2 GiB (2.4 GiB) at once.
_SLICE_ELEMENTS = 1 << 24


def score_prompt_tokens(logits: torch.Tensor, targets: list[int], tops: list[int]) -> list[TokenLogprob]:
    """logits [P, V] (any float dtype) of the positions before the prompt tokens targets [P];
    tops[i]: how many alternatives row i keeps. One device->host copy for all rows."""
    num_rows, vocab_size = logits.shape
    top = max(tops)
    target_ids = torch.tensor(targets, dtype=torch.long).to(logits.device, non_blocking=True)  # [P]
    per_slice = max(1, _SLICE_ELEMENTS // vocab_size)
    packed = []
    for lo in range(0, num_rows, per_slice):
        logp = torch.log_softmax(logits[lo:lo + per_slice].float(), dim=-1)  # [S, V]
        chosen = logp.gather(1, target_ids[lo:lo + per_slice, None])  # [S, 1]
        rank = (logp >= chosen).sum(-1, keepdim=True)  # [S, 1]
        top_values, top_ids = ranked_top_logprobs(logp, top)  # [S, N]
        # float64 holds int64 ids and ranks < 2^53 and fp32 logprobs exactly: one tensor, one copy
        packed.append(torch.cat([chosen.double(), rank.double(), top_ids.double(), top_values.double()], dim=1))
    rows = torch.cat(packed).tolist()  # [P, 2 + 2N]
    return [_unpack(target, row, top, n) for target, n, row in zip(targets, tops, rows)]


def _unpack(target: int, row: list[float], top: int, n: int) -> TokenLogprob:
    """One packed row [logprob, rank, top ids (top of them), their logprobs (top)], keeping the n best."""
    ids, values = row[2:2 + n], row[2 + top:2 + top + n]
    return TokenLogprob(target, row[0], tuple(zip(map(int, ids), values)), rank=int(row[1]))
