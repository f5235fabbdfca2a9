"""The sampler's draw for a whole batch in one Triton kernel, under the grammar masks: greedy rows'
argmax, or sampled rows' exponential race (sampler.py) without top-k, top-p or min-p.

On a small model's ~0.5-1 ms decode step the sampler's host time is much of the step: the race
as torch ops is ~20 launches (the noise's integer hash, its float64 log, the softmax, the division,
the argmax), and a grammar's mask one more (token_mask.py). Here each row's program makes the same
noise from the same hash of (row key, token) that sampler.noise_bits gives, reads its mask bits
where they were filled (pinned host rows, over UVA, as token_mask.py does), and keeps the best
token in one pass over the row: one launch for the step, masked or not (two when greedy and
sampled rows share the batch: the sampled ones' tokens overwrite the argmax's).

A sampled row picks argmax_v (s_v - max s) / T - log E_v over its allowed tokens, which is the
torch path's argmax_v softmax(s / T)_v / E_v taken in log space: the two agree except where two
candidates tie to rounding, as CPU and CUDA already do (sampler.py). Ties go to the lowest id, as
torch's argmax gives them.
"""
from __future__ import annotations

import torch

from moe_serve.engine.token_mask import TokenMask

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.token_mask import allowed_logits
except ImportError:  # no triton: the sampler's torch path only
    triton = None

_BLOCK = 1024  # tokens a program takes per loop step


def race_tokens(logits: torch.Tensor, mask: TokenMask | None, temperature: torch.Tensor | None = None,
                noise_key: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                tokens: torch.Tensor | None = None) -> torch.Tensor:
    """Rows' tokens: logits [B, V] (fp32 for sampled rows); mask's bits [B, W] (None: every token allowed);
    temperature and noise_key [S] of the sampled rows `rows` [S] (sampler.SamplingBatch; rows None: all
    B), or none of the three for greedy rows. Written into tokens [B] int64 (new when None), returned."""
    assert logits.stride(1) == 1, "a program reads its row's logits in one run"
    if tokens is None:
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    sampled = temperature is not None and noise_key is not None
    programs = logits.shape[0] if rows is None else rows.shape[0]
    _race_kernel[(programs,)](
        logits, logits.stride(0), logits.shape[1], logits if mask is None else mask.bits,
        0 if mask is None else mask.bits.shape[1], temperature if sampled else logits,
        noise_key if sampled else tokens, tokens if rows is None else rows, tokens,
        MASKED=mask is not None, SAMPLED=sampled, GATHER=rows is not None, BLOCK=_BLOCK,
    )
    if mask is not None:
        mask.record_read()
    return tokens


if triton is not None:
    @triton.jit
    def _mix32_rest(x):
        """sampler._mix32_rest on int64 values below 2^32, its products masked to 32 bits as there."""
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x = x ^ (x >> 12)
        x = (x * 0x297A2D39) & 0xFFFFFFFF
        return x ^ (x >> 15)

    @triton.jit
    def _race_kernel(logits_ptr, row_stride, vocab_size, bits_ptr, words_per_row, temperature_ptr, noise_key_ptr,
                     rows_ptr, tokens_ptr, MASKED: tl.constexpr, SAMPLED: tl.constexpr, GATHER: tl.constexpr,
                     BLOCK: tl.constexpr):
        program = tl.program_id(0)
        row = tl.load(rows_ptr + program) if GATHER else program.to(tl.int64)  # program p: the p-th of rows
        logits_row = logits_ptr + row * row_stride
        token = tl.arange(0, BLOCK)
        if SAMPLED:  # the race scales by the temperature after the best allowed logit is taken off
            top = tl.full([BLOCK], float("-inf"), tl.float32)
            for start in range(0, vocab_size, BLOCK):
                top = tl.maximum(top, allowed_logits(logits_row, bits_ptr, row, words_per_row, vocab_size,
                                                      start + token, MASKED))
            shift = tl.max(top, 0)
            temperature = tl.load(temperature_ptr + program)
            key = tl.load(noise_key_ptr + program)
            key = key ^ (key >> 15)  # the row's part of the first xor-shift (sampler.noise_bits)
        best = tl.full([], float("-inf"), tl.float32)
        best_token = tl.full([], 0, tl.int64)
        for start in range(0, vocab_size, BLOCK):
            v = start + token
            score = allowed_logits(logits_row, bits_ptr, row, words_per_row, vocab_size, v, MASKED)
            if SAMPLED:  # the hash of sampler.noise_bits: the token's part as _shifted_token_hashes makes it
                salted = v.to(tl.int64) ^ 0x9E3779B9
                token_hash = _mix32_rest(salted ^ (salted >> 15))
                bits = _mix32_rest(key ^ token_hash ^ (token_hash >> 15))
                u = (bits.to(tl.float64) + 0.5) * 2.3283064365386963e-10  # (bits + 1/2) / 2^32, inside (0, 1)
                noise = (-tl.log(u)).to(tl.float32)  # Exp(1), rounded to fp32 as exponential_noise does
                score = (score - shift) / temperature - tl.log(noise)
            block_best = tl.max(score, 0)
            # strictly greater: of equal bests the earlier block's, and argmax's own ties go to the lowest id
            best_token = tl.where(block_best > best, start + tl.argmax(score, 0).to(tl.int64), best_token)
            best = tl.maximum(best, block_best)
        tl.store(tokens_ptr + row, best_token)
