"""Batched next-token sampling on the device: penalties, argmax or seeded draws, logprobs for B rows.

Each row keeps the per-sequence semantics of moe_serve/engine/sampling.py and decode.choose_token, under
its own SamplingParams: logit_bias, then the stop tokens masked while the row is below
min_tokens, vLLM's repetition penalty over its prompt and output, presence/frequency penalties
over the tokens it has generated; then temperature 0 takes the argmax (ties: the lowest token
id), anything else scales by the temperature, drops tokens below min_p, truncates with top-k
and top-p and draws; logprobs are read off the penalised logits before temperature. Greedy and
sampled rows, with and without logprobs, penalties or extras, mix freely in one batch, `sample`
has no Python loop over rows, and a batch whose rows use none of the extras runs none of their
tensor work. Rows under a grammar (moe_serve/engine/structured.py) choose among the tokens its mask
allows, in one pass over the batch (TokenMask); their logprobs stay the model's. On CUDA a batch none
of whose sampled rows truncates (top-k, top-p, min-p) draws, masked or not, in
one kernel (moe_serve/engine/race.py; two where greedy and sampled rows mix), the mask read inside it.

Why the draw is counter-based. Under continuous batching a request meets different neighbours
at every step, and may run alone, batched, on the CPU or on CUDA; its seed must still give the
same tokens. A shared torch.Generator would hand each row whatever part of the stream its
neighbours left, and a per-request Generator cannot draw for the whole batch in one kernel. So
each row draws with the exponential race: token = argmax_v p_v / E_v with E_v ~ Exp(1) i.i.d.
picks v with probability p_v exactly (p need not even be normalised). E_v = -log(u_v), and u_v
in (0, 1) comes from a 32-bit integer hash of (seed, step, v), where step is the number of tokens
the row has generated so far: the row's part, a hash of (seed, step), is computed on the host with
the batch's other parameters (on the device it was ~30 launches on [S] tensors, most of a sampled
step's host time), the token's part once per vocabulary, and they are mixed with int64 tensor ops.
Integer ops give the same bits on every device, so a row's draw depends only on its seed, its step
and its own probabilities:
not on its batch, its position in it, or the device. (E itself goes through a float64 log
rounded to float32, which CPU and CUDA agree on except, in principle, within one float32 ulp;
the probabilities are float32 reductions, so tokens of two devices differ only where two
candidates' p/E tie to rounding.)
"""
from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from itertools import chain, repeat
from math import inf, log
from typing import TypeVar

import torch

from moe_serve.engine.messages import SamplingParams, TokenLogprob
from moe_serve.engine.race import race_tokens
from moe_serve.engine.token_mask import TokenMask

_TINY = torch.finfo(torch.float32).tiny  # the smallest temperature kept (see sampling.target_distribution)
_MASK32 = 0xFFFFFFFF
_MASK64 = 2**64 - 1
_TOKEN_SALT = 0x9E3779B9  # keeps token 0 off the hash's fixed point at 0
Int = TypeVar("Int", int, torch.Tensor)


@dataclass(frozen=True)
class SamplingRow:
    """What the engine knows of one sequence when it samples that sequence's next token."""

    params: SamplingParams
    seed: int  # the request's seed, or one the engine drew at arrival; any int (taken mod 2^64)
    output_ids: Sequence[int]  # tokens generated so far: the penalties' counts, and the draw's step
    prompt_ids: Sequence[int] = ()  # what the repetition penalty sees besides output_ids


@dataclass(frozen=True)
class SamplingBatch:
    """One step's sampling inputs for B rows: device tensors, plus host facts that skip work.

    Only the S sampled rows (temperature > 0) carry temperature, top-k, top-p and noise key:
    greedy rows need none of them."""

    sampled_rows: torch.Tensor  # [S] int64: the rows with temperature > 0, ascending
    temperature: torch.Tensor  # [S] fp32, at least float32's smallest normal
    top_k: torch.Tensor  # [S] int64, 0 = off
    top_p: torch.Tensor  # [S] fp32
    noise_key: torch.Tensor  # [S] int64: row_noise_key(seed, step), step = tokens the row has generated
    presence: torch.Tensor  # [B] fp32 (read only with output_ids: empty when no row is penalised)
    frequency: torch.Tensor  # [B] fp32
    output_ids: torch.Tensor | None  # [B, L] int64, -1 padded, only penalised rows filled; None: none is
    logprobs: tuple[int | None, ...]  # [B] each row's params.logprobs (None = off)
    any_top_k: bool  # some sampled row has top_k > 0
    any_top_p: bool  # some sampled row has top_p < 1
    # vLLM's extras; each None when no row of the batch uses it, so such a batch skips its work
    # [B, K] int64, -1 padded: logit_bias tokens, and the stop tokens of rows below min_tokens
    bias_ids: torch.Tensor | None = None
    bias: torch.Tensor | None = None  # [B, K] fp32: added to those tokens' logits (-inf: the stop tokens)
    seen_ids: torch.Tensor | None = None  # [B, P] int64, -1 padded: prompt + output of rows with a repetition penalty
    repetition: torch.Tensor | None = None  # [B] fp32, 1 = off
    log_min_p: torch.Tensor | None = None  # [S] fp32: log(min_p), -inf = off

    @property
    def adjusts_logits(self) -> bool:
        """Whether some row's logits change before temperature (biases, min_tokens, penalties)."""
        return self.output_ids is not None or self.bias_ids is not None or self.seen_ids is not None

    @property
    def truncates(self) -> bool:
        """Whether some sampled row cuts its distribution (top-k, top-p, min-p): race.py draws only without."""
        return self.any_top_k or self.any_top_p or self.log_min_p is not None

    @property
    def size(self) -> int:
        return len(self.logprobs)

    @property
    def num_sampled(self) -> int:
        return self.sampled_rows.shape[0]

    @property
    def max_logprobs(self) -> int | None:
        """The most top alternatives any row asked for; None when no row wants logprobs."""
        return max((n for n in self.logprobs if n is not None), default=None)

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], device: torch.device | str) -> "SamplingBatch":
        """Gather the rows' parameters on the host and send them to device in one copy."""
        if not rows:
            raise ValueError("a sampling batch needs at least one row")
        sampled = [i for i, row in enumerate(rows) if row.params.temperature > 0]
        params = [rows[i].params for i in sampled]
        penalised = [row.output_ids if _has_penalties(row) else () for row in rows]
        width = max(map(len, penalised))
        # the extras' host work only when some row uses them
        biased = any(row.params.logit_bias or len(row.output_ids) < row.params.min_tokens for row in rows)
        repeated = any(row.params.repetition_penalty != 1.0 for row in rows)
        if not (sampled or width or biased or repeated):
            # greedy rows and no extras: sample() takes the argmax and reads none of the tensors, so
            # none is sent (on CUDA the pinned copy and its views cost ~50 us of host time a step,
            # 7% of a default-model step at bs=1)
            no_floats, no_ints = _empty(torch.device(device))
            return cls(no_ints, no_floats, no_ints, no_floats, no_ints, no_floats, no_floats, None,
                       tuple(row.params.logprobs for row in rows), False, False)
        biases = [_biases(row) for row in rows] if biased else []
        bias_width = max(map(len, biases), default=0)
        seen = [[*row.prompt_ids, *row.output_ids] if row.params.repetition_penalty != 1.0 else () for row in rows
                ] if repeated else []
        seen_width = max(map(len, seen), default=0)
        any_min_p = any(p.min_p > 0 for p in params)
        floats = [[max(p.temperature, _TINY) for p in params], [p.top_p for p in params],
                  [row.params.presence_penalty for row in rows], [row.params.frequency_penalty for row in rows],
                  [v for b in biases for v in chain((v for _, v in b), repeat(0.0, bias_width - len(b)))],
                  [row.params.repetition_penalty for row in rows] if seen_width else [],
                  [log(p.min_p) if p.min_p > 0 else -inf for p in params] if any_min_p else []]
        ints = [sampled, [p.top_k for p in params],
                [row_noise_key(rows[i].seed, len(rows[i].output_ids)) for i in sampled], _padded(penalised, width),
                _padded([[t for t, _ in b] for b in biases], bias_width) if bias_width else [],
                _padded(seen, seen_width) if seen_width else []]
        (temperature, top_p, presence, frequency, bias, repetition, log_min_p), \
            (sampled_rows, top_k, noise_key, flat_ids, bias_ids, seen_ids) = \
            _upload(floats, ints, torch.device(device))
        size = len(rows)
        return cls(sampled_rows, temperature, top_k, top_p, noise_key, presence, frequency,
                   flat_ids.view(size, width) if width else None,
                   tuple(row.params.logprobs for row in rows),
                   any(p.top_k > 0 for p in params), any(p.top_p < 1.0 for p in params),
                   bias_ids=bias_ids.view(size, bias_width) if bias_width else None,
                   bias=bias.view(size, bias_width) if bias_width else None,
                   seen_ids=seen_ids.view(size, seen_width) if seen_width else None,
                   repetition=repetition if seen_width else None, log_min_p=log_min_p if any_min_p else None)


@dataclass(frozen=True)
class SampledTokens:
    """A step's tokens and logprobs, still on the device."""

    tokens: torch.Tensor  # [B] int64
    logprob: torch.Tensor | None  # [B] fp32: log-probability of the chosen token; None: no row asked
    top_ids: torch.Tensor | None  # [B, N] int64, N = the batch's largest logprobs, best first
    top_logprobs: torch.Tensor | None  # [B, N] fp32
    logprobs: tuple[int | None, ...]  # [B] each row's params.logprobs

    def to_host(self) -> tuple[list[int], list[TokenLogprob | None]]:
        """Tokens and per-row TokenLogprob (None where a row asked for none), in one device->host copy."""
        if self.logprob is None or self.top_ids is None or self.top_logprobs is None:
            return self.tokens.tolist(), [None] * len(self.logprobs)
        # float64 holds int64 token ids < 2^53 and fp32 logprobs exactly: one tensor, one copy. cat
        # promotes every part to the float64 of one of them, so the conversions cost no launches of their own
        packed = torch.cat([self.tokens[:, None], self.logprob[:, None].double(), self.top_ids, self.top_logprobs],
                           dim=1).tolist()  # [B, 2 + 2N]
        width = self.top_ids.shape[1]
        tokens = [int(row[0]) for row in packed]
        logprobs = [None if n is None else TokenLogprob(int(row[0]), row[1], tuple(
            (int(i), v) for i, v in zip(row[2:2 + n], row[2 + width:2 + width + n])))
            for row, n in zip(packed, self.logprobs)]
        return tokens, logprobs


def sample(logits: torch.Tensor, batch: SamplingBatch,
           allowed: Callable[[], TokenMask] | None = None) -> SampledTokens:
    """The next token of every row. logits [B, V], any float dtype, on the batch's device.

    allowed: gives the grammar masks (moe_serve/engine/structured.py); None when no row is constrained.
    A row's token is chosen among the ones its mask allows; its logprobs are the model's. It is
    called once the work that does not need the masks is queued (the draws' noise, the logprobs):
    the grammar process (moe_serve/engine/grammar_process.py) fills them beside those launches."""
    top = batch.max_logprobs
    if not batch.adjusts_logits and batch.num_sampled == 0 and top is None and allowed is None:
        return SampledTokens(logits.argmax(-1), None, None, None, batch.logprobs)  # greedy only: one argmax
    logits = _adjusted(logits.float(), batch)  # [B, V]
    logp = None if top is None else torch.log_softmax(logits, dim=-1)  # [B, V]
    if logits.is_cuda and not batch.truncates:  # race.py: one kernel (two with greedy and sampled rows)
        return _with_logprobs(_race(logits, batch, None if allowed is None else allowed()), logp, top, batch)
    noise = exponential_noise(batch.noise_key, logits.shape[-1]) if batch.num_sampled else None  # [S, V]
    candidates = logits if allowed is None else allowed().restrict(logits)  # [B, V]
    if batch.num_sampled == batch.size:
        tokens = _draw(candidates, batch, noise)  # [B]
    else:
        tokens = candidates.argmax(-1)  # [B]
        if batch.num_sampled:
            tokens.index_copy_(0, batch.sampled_rows,
                               _draw(candidates.index_select(0, batch.sampled_rows), batch, noise))
    return _with_logprobs(tokens, logp, top, batch)


def _race(logits: torch.Tensor, batch: SamplingBatch, mask: TokenMask | None) -> torch.Tensor:
    """Every row's token [B] from race.py's kernel: the greedy rows' argmax, the sampled rows' race."""
    if batch.num_sampled == batch.size:
        return race_tokens(logits, mask, batch.temperature, batch.noise_key)
    tokens = logits.argmax(-1) if mask is None else race_tokens(logits, mask)  # [B] (torch's launch is cheaper)
    if batch.num_sampled:
        race_tokens(logits, mask, batch.temperature, batch.noise_key, batch.sampled_rows, tokens)
    return tokens


def _with_logprobs(tokens: torch.Tensor, logp: torch.Tensor | None, top: int | None,
                   batch: SamplingBatch) -> SampledTokens:
    """The chosen tokens [B] with their logprobs and the top alternatives (batch.max_logprobs: top),
    read off logp [B, V]."""
    if logp is None:
        return SampledTokens(tokens, None, None, None, batch.logprobs)
    chosen = logp.gather(1, tokens[:, None])[:, 0]  # [B]
    top_logprobs, top_ids = ranked_top_logprobs(logp, top)  # [B, N]
    return SampledTokens(tokens, chosen, top_ids, top_logprobs, batch.logprobs)


def _adjusted(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Biases and min_tokens' mask, the repetition penalty, then presence/frequency. [B, V] -> [B, V]."""
    if batch.bias_ids is not None and batch.bias is not None:
        logits = logits + _scattered(batch.bias_ids, batch.bias, logits.shape[-1])
    if batch.seen_ids is not None and batch.repetition is not None:
        logits = _apply_repetition_penalty(logits, batch.seen_ids, batch.repetition)
    if batch.output_ids is not None:
        logits = _apply_penalties(logits, batch.output_ids, batch.presence, batch.frequency)
    return logits


def ranked_top_logprobs(logp: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The n best of each row, ties going to the lower id. [B, V] fp32 -> values, ids [B, n].

    topk alone leaves the order among equal values unspecified, and bf16 logits tie often: a row's
    alternatives could then change with its batch. One int64 key per token, its value's float
    bits made order-preserving above the reversed token id, is a total order."""
    bits = logp.view(torch.int32)  # [B, V]
    ordered = (bits ^ ((bits >> 31) & 0x7FFFFFFF)).long()  # ascending as the floats ascend (no NaN)
    keys = (ordered << 32) | _reversed_ids(logp.shape[-1], logp.device)  # [B, V]
    ids = logp.shape[-1] - 1 - (keys.topk(n, dim=-1).values & _MASK32)  # [B, n]
    return logp.gather(1, ids), ids


@cache
def _reversed_ids(vocab_size: int, device: torch.device) -> torch.Tensor:
    """[V] int64 V-1, ..., 0: ranked_top_logprobs' tie-breaking key, made once per vocabulary and
    device rather than per step (two launches on the engine thread for every step with logprobs)."""
    return torch.arange(vocab_size - 1, -1, -1, device=device)


def row_noise_key(seed: int, step: int) -> int:
    """The row's part of the noise hash: _mix32 chained over the seed's low and high 32 bits (the
    seed taken mod 2^64) and the step. Plain integers: the same bits the tensor ops would give."""
    return _mix32(_seed_key(seed) ^ (step & _MASK32))


@lru_cache(maxsize=4096)
def _seed_key(seed: int) -> int:
    """row_noise_key's part that a request keeps for all its steps (kept: ~1 us of Python per row
    and step otherwise, 64 us a step at 64 sampled rows)."""
    seed &= _MASK64
    return _mix32(_mix32((seed & _MASK32) ^ _TOKEN_SALT) ^ (seed >> 32))


def noise_bits(noise_key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A 32-bit hash of (row key, token id) for every token: [S] int64 -> [S, V] int64.

    Values lie in [0, 2^32); integer ops only, so every device gives the same bits."""
    # = _mix32(key[:, None] ^ tokens[None, :]): its first xor-shift distributes over the xor, so it
    # runs on the [S] vector and the cached [V] one instead of the [S, V] product
    tokens = _shifted_token_hashes(vocab_size, noise_key.device)  # [V]
    return _mix32_rest(_xorshift(noise_key, 15)[:, None] ^ tokens[None, :])  # [S, V]


@cache
def _shifted_token_hashes(vocab_size: int, device: torch.device) -> torch.Tensor:
    """xorshift(_mix32(v ^ salt), 15) for every token id v: [V] int64, made once per vocabulary and device."""
    tokens = _mix32(torch.arange(vocab_size, dtype=torch.int64, device=device) ^ _TOKEN_SALT)
    return _xorshift(tokens, 15)


def exponential_noise(noise_key: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) draws E = -log(u), u = (bits + 1/2) / 2^32 strictly inside (0, 1). [S] -> [S, V] fp32."""
    u = noise_bits(noise_key, vocab_size).double().add_(0.5).mul_(2.0**-32)  # [S, V]
    return u.log_().neg_().float()


def _draw(logits: torch.Tensor, batch: SamplingBatch, noise: torch.Tensor) -> torch.Tensor:
    """Temperature, top-k, top-p and the exponential race for the sampled rows, under their
    exponential_noise [S, V]. [S, V] -> [S]."""
    # shifted so the top logit is 0 first, as sampling.target_distribution does (tiny temperatures)
    scaled = (logits - logits.amax(-1, keepdim=True)) / batch.temperature[:, None]  # [S, V]
    if batch.log_min_p is not None:  # p_v < min_p * p_max, as scaled logits: the best one is 0
        scaled = scaled.masked_fill(scaled < batch.log_min_p[:, None], float("-inf"))
    if batch.any_top_k or batch.any_top_p:
        probs = _truncated_probs(scaled, batch)
    else:
        probs = torch.softmax(scaled, dim=-1)  # [S, V]
    return (probs / noise).argmax(-1)  # [S]


def _truncated_probs(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """softmax after each row's top-k, then zeroed outside each row's top-p (not renormalised:
    the race does not need it). scaled [S, V] -> probs [S, V]."""
    vocab_size = scaled.shape[-1]
    # stable: of tokens tied at a top-p cut-off, the lower ids stay, in any batch
    sorted_scaled, order = torch.sort(scaled, dim=-1, descending=True, stable=True)  # [S, V]
    if batch.any_top_k:
        k = torch.where((batch.top_k > 0) & (batch.top_k < vocab_size), batch.top_k, vocab_size)  # [S]
        kth = sorted_scaled.gather(1, (k - 1)[:, None])  # [S, 1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)  # [S, V]
    if not batch.any_top_p:
        return probs
    # top-k only cut the tail of the order, so it still sorts probs descending
    sorted_probs = probs.gather(1, order)  # [S, V]
    # keep the smallest prefix whose mass reaches top_p (the first token always stays)
    drop = (sorted_probs.cumsum(-1) - sorted_probs) >= batch.top_p[:, None]
    drop &= (batch.top_p < 1.0)[:, None]
    return probs.masked_fill(torch.zeros_like(drop).scatter_(1, order, drop), 0.0)


def _apply_penalties(logits: torch.Tensor, output_ids: torch.Tensor, presence: torch.Tensor,
                     frequency: torch.Tensor) -> torch.Tensor:
    """OpenAI penalties as sampling.apply_penalties gives them per row. logits [B, V], output_ids [B, L]."""
    batch_size, vocab_size = logits.shape
    ids = output_ids.masked_fill(output_ids < 0, vocab_size)  # [B, L]: padding counts in a spare column
    counts = torch.zeros(batch_size, vocab_size + 1, dtype=torch.float32, device=logits.device)
    counts = counts.scatter_add_(1, ids, torch.ones(ids.shape, device=ids.device))[:, :vocab_size]  # [B, V]
    return logits - (frequency[:, None] * counts + presence[:, None] * (counts > 0))


def _scattered(ids: torch.Tensor, values: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Dense [B, V] fp32 of sparse [B, K] entries (ids -1 padded; repeated ids add up)."""
    dense = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.float32, device=ids.device)
    return dense.scatter_add_(1, ids.masked_fill(ids < 0, vocab_size), values)[:, :vocab_size]  # padding: spare column


def _apply_repetition_penalty(logits: torch.Tensor, seen_ids: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """vLLM's (and HF's): a token seen in the prompt or output has its logit divided by the penalty
    if positive, multiplied if not. logits [B, V], seen_ids [B, P], penalty [B]."""
    batch_size, vocab_size = logits.shape
    ids = seen_ids.masked_fill(seen_ids < 0, vocab_size)  # [B, P]
    seen = torch.zeros(batch_size, vocab_size + 1, dtype=torch.bool, device=logits.device)
    seen = seen.scatter_(1, ids, True)[:, :vocab_size]  # [B, V]
    scale = torch.where(seen, penalty[:, None], 1.0)  # [B, V]
    return torch.where(logits > 0, logits / scale, logits * scale)


def _mix32(x: Int) -> Int:
    """A bijective 32-bit hash (Wellons' prospector32) of values in [0, 2^32): int64 tensors, or ints.

    Both multipliers are below 2^31, so x * m < 2^63: int64 never overflows and masking to 32
    bits after each multiply leaves exactly the 32-bit product, on every device and on the host."""
    return _mix32_rest(_xorshift(x, 15))


def _mix32_rest(x: Int) -> Int:
    """_mix32 after its first xor-shift; in place on a tensor (an [S, V] int64 is large)."""
    x *= 0x2C1B3C6D
    x &= _MASK32
    x ^= x >> 12
    x *= 0x297A2D39
    x &= _MASK32
    x ^= x >> 15
    return x


def _xorshift(x: Int, shift: int) -> Int:
    return x ^ (x >> shift)


def _has_penalties(row: SamplingRow) -> bool:
    return bool(row.output_ids) and (row.params.presence_penalty != 0 or row.params.frequency_penalty != 0)


def _biases(row: SamplingRow) -> list[tuple[int, float]]:
    """The row's logit_bias, and -inf on its stop tokens while it is below min_tokens."""
    early = len(row.output_ids) < row.params.min_tokens
    return [*row.params.logit_bias, *((t, -inf) for t in (row.params.stop_token_ids if early else ()))]


@cache
def _empty(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-length fp32 and int64 tensors on device: the fields of a batch that sends nothing."""
    return torch.empty(0, device=device), torch.empty(0, dtype=torch.int64, device=device)


def _padded(id_lists: list[Sequence[int]], width: int) -> array:
    """The rows' ids, each padded with -1 to width, flat. (array: a C loop, not a Python one per id.)"""
    flat, padding = array("q"), array("q", [-1]) * width
    for ids in id_lists:
        flat.extend(ids)
        flat.extend(padding[len(ids):])
    return flat


def _upload(floats: list[list[float]], ints: list[Sequence[int]],
            device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Send fp32 and int64 host values to device in one copy: the fp32 values travel as their bits."""
    flat = array("q", array("i", array("f", chain.from_iterable(floats)).tobytes()))  # fp32 bits, widened
    for part in ints:
        flat.extend(part)
    host = torch.frombuffer(flat, dtype=torch.int64)
    sent = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host.clone()
    num_floats = sum(map(len, floats))
    float_part = sent[:num_floats].int().view(torch.float32)
    return (list(float_part.split([len(part) for part in floats])),
            list(sent[num_floats:].split([len(part) for part in ints])))
