"""The batched sampler against today's per-sequence sampling (sampling.py, decode.choose_token).

Greedy tokens and logprobs must equal the per-row functions; sampled tokens cannot (the draw is
a different random source), so they must follow sampling.target_distribution, stay inside its
top-k / top-p support, and depend only on (seed, step, the row's own logits and params): the
same alone as in any batch, on every call and on every device.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from math import sqrt

import pytest
import torch

from moe_serve.engine.decode import choose_token
from moe_serve.engine.messages import SamplingParams, TokenLogprob
from moe_serve.engine.sampler import SamplingBatch, SamplingRow, exponential_noise, noise_bits, row_noise_key, sample
from moe_serve.engine.sampling import (apply_penalties, draft_verify_honours, forbid_stop_tokens, target_distribution,
                             token_logprob)
from moe_serve.engine.sequence import Sequence
from tests.engine.test_token_mask import token_mask

CPU = torch.device("cpu")
VOCAB = 48


def run(logits: torch.Tensor, rows: list[SamplingRow], device: torch.device = CPU
        ) -> tuple[list[int], list[TokenLogprob | None]]:
    return sample(logits.to(device), SamplingBatch.build(rows, device)).to_host()


def penalised(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    return apply_penalties(logits, row.params, Counter(row.output_ids))


def random_row(rng: random.Random, vocab: int = VOCAB) -> SamplingRow:
    params = SamplingParams(
        max_tokens=64, temperature=rng.choice([0.0, 0.0, 1e-40, 0.5, 1.0, 1.7]),
        top_k=rng.choice([0, 0, 1, 5, vocab - 1, vocab, vocab + 3]), top_p=rng.choice([1.0, 1.0, 0.9, 0.3, 1e-6]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -0.7]), frequency_penalty=rng.choice([0.0, 0.3, 1.1]),
        logprobs=rng.choice([None, None, 0, 3, 20]))
    output_ids = [rng.randrange(vocab) for _ in range(rng.randrange(12))]
    return SamplingRow(params, rng.randrange(-2**63, 2**64), output_ids)


def test_greedy_equals_choose_token_with_penalties_and_ties() -> None:
    rng = random.Random(0)
    logits = torch.randn(40, VOCAB, generator=torch.Generator().manual_seed(0))  # [B, V]
    logits[0, 3] = logits[0, 7] = logits[0].max() + 1.0  # a tie: the lower id wins
    logits[1, 9], logits[1, 4] = 6.0, 5.5  # penalties turn 9 into a tie with 4: 6 - (2*0.25 + 0) = 5.5
    rows = [SamplingRow(SamplingParams(8, temperature=0.0, logprobs=2), 7, []),
            SamplingRow(SamplingParams(8, temperature=0.0, frequency_penalty=0.25, logprobs=5), 1, [9, 9]),
            *[SamplingRow(replace(row.params, temperature=0.0), row.seed, row.output_ids)
              for row in (random_row(rng) for _ in range(38))]]
    tokens, logprobs = run(logits, rows)
    assert tokens[0] == 3 and tokens[1] == 4
    assert [t for t, _ in logprobs[0].top] == [3, 7]  # tied alternatives: the lower id first
    for b, row in enumerate(rows):
        seq = Sequence("r", [0], row.params, row.seed, output_ids=list(row.output_ids),
                       output_counts=Counter(row.output_ids))
        token, logprob = choose_token(seq, logits[b], torch.Generator())  # greedy: the generator goes unused
        assert tokens[b] == token
        assert_logprob_close(logprobs[b], logprob)


def test_greedy_only_batch_takes_any_float_dtype() -> None:
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1)).bfloat16()
    rows = [SamplingRow(SamplingParams(8, temperature=0.0), seed, []) for seed in range(6)]
    tokens, logprobs = run(logits, rows)
    assert tokens == logits.float().argmax(-1).tolist() and logprobs == [None] * 6


def test_a_greedy_batch_without_extras_sends_nothing_and_still_gives_logprobs() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [SamplingRow(SamplingParams(8, temperature=0.0, logprobs=n, presence_penalty=0.5), 0, [])
            for n in (None, 0, 3)]  # a penalty with no output yet changes nothing
    batch = SamplingBatch.build(rows, CPU)
    assert batch.num_sampled == 0 and batch.output_ids is None and batch.presence.numel() == 0
    tokens, logprobs = run(logits, rows)
    assert tokens == logits.argmax(-1).tolist() and logprobs[0] is None
    for b in (1, 2):
        assert_logprob_close(logprobs[b], token_logprob(logits[b], tokens[b], rows[b].params.logprobs))


def test_logprobs_equal_token_logprob_of_penalised_logits() -> None:
    rng = random.Random(1)
    rows = [random_row(rng) for _ in range(60)]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(2)) * 3  # [B, V]
    logits[::2] = logits[::2].bfloat16().float()  # coarse values: tied alternatives
    tokens, logprobs = run(logits, rows)
    for b, row in enumerate(rows):
        want = None if row.params.logprobs is None else token_logprob(penalised(logits[b], row), tokens[b],
                                                                     row.params.logprobs)
        assert_logprob_close(logprobs[b], want)


def test_a_row_samples_the_same_alone_and_in_any_batch() -> None:
    rng = random.Random(2)
    gen = torch.Generator().manual_seed(3)
    for _ in range(8):
        rows = [random_row(rng) for _ in range(rng.randrange(2, 40))]
        logits = torch.round(torch.randn(len(rows), VOCAB, generator=gen) * 8) / 4  # [B, V], many ties
        batched = run(logits, rows)
        alone = [run(logits[b:b + 1], [row]) for b, row in enumerate(rows)]
        assert batched == ([tokens[0] for tokens, _ in alone], [logprobs[0] for _, logprobs in alone])
        perm = rng.sample(range(len(rows)), len(rows))
        shuffled = run(logits[perm], [rows[i] for i in perm])
        assert shuffled == ([batched[0][i] for i in perm], [batched[1][i] for i in perm])


def test_sampling_is_deterministic_and_the_draw_moves_with_seed_and_step() -> None:
    rng = random.Random(3)
    rows = [SamplingRow(SamplingParams(8, temperature=1.0), rng.randrange(2**64), [1] * rng.randrange(9))
            for _ in range(200)]
    logits = torch.zeros(len(rows), VOCAB)  # uniform: the noise alone picks the token
    first, second = run(logits, rows), run(logits, rows)
    assert first == second
    assert len(set(first[0])) > VOCAB // 2
    keys = torch.tensor([row_noise_key(seed, step) for seed, step in ((5, 0), (5, 1), (5 + 2**32, 0), (-5, 0))])
    bits = noise_bits(keys, VOCAB)  # [4, V]
    assert torch.equal(bits, noise_bits(keys, VOCAB))
    assert all(not torch.equal(bits[0], bits[i]) for i in (1, 2, 3))  # step, high seed bits, sign
    assert row_noise_key(-1, 3) == row_noise_key(2**64 - 1, 3)  # the seed is taken mod 2^64


def reference_bits(seed: int, step: int, token: int) -> int:
    """noise_bits' definition, one token at a time in plain Python: (seed, step, token) -> [0, 2^32)."""
    def mix(x: int) -> int:
        x ^= x >> 15
        x = (x * 0x2C1B3C6D) & 0xFFFFFFFF
        x ^= x >> 12
        x = (x * 0x297A2D39) & 0xFFFFFFFF
        return x ^ (x >> 15)
    seed &= 2**64 - 1
    key = mix(mix(mix((seed & 0xFFFFFFFF) ^ 0x9E3779B9) ^ (seed >> 32)) ^ step)
    return mix(key ^ mix(token ^ 0x9E3779B9))


def test_noise_bits_match_their_scalar_definition() -> None:
    cases = [(0, 0), (1, 0), (-1, 7), (2**63 - 1, 4095), (-2**63, 1), (123456789123, 99)]
    bits = noise_bits(torch.tensor([row_noise_key(seed, step) for seed, step in cases]), VOCAB)
    assert bits.tolist() == [[reference_bits(seed, step, v) for v in range(VOCAB)] for seed, step in cases]


def test_noise_is_exp1_strictly_inside_its_range() -> None:
    noise = exponential_noise(torch.tensor([row_noise_key(seed, 7 * seed) for seed in range(2000)]), 500)  # [S, V]
    assert torch.isfinite(noise).all() and (noise > 0).all()
    assert abs(float(noise.mean()) - 1.0) < 0.01 and abs(float(noise.var()) - 1.0) < 0.02
    # extremes of the bits: u = 2^-33 and 1 - 2^-33 still give finite, positive E
    u = (torch.tensor([0, 2**32 - 1]).double() + 0.5) * 2.0**-32
    assert (u > 0).all() and (u < 1).all() and torch.isfinite(-u.log()).all() and (-u.log() > 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_and_cuda_draw_the_same() -> None:
    cuda = torch.device("cuda")
    rng = random.Random(6)
    keys = torch.tensor([row_noise_key(rng.randrange(2**64), rng.randrange(10_000)) for _ in range(512)])
    bits = noise_bits(keys, 4096)
    assert torch.equal(bits, noise_bits(keys.to(cuda), 4096).cpu())
    noise = exponential_noise(keys, 4096)
    torch.testing.assert_close(exponential_noise(keys.to(cuda), 4096).cpu(), noise,
                               rtol=2.0**-23, atol=0.0)  # at most an ulp apart (the log), bit-equal in practice
    rng = random.Random(4)
    rows = [random_row(rng, vocab=4096) for _ in range(256)]
    logits = torch.randn(len(rows), 4096, generator=torch.Generator().manual_seed(5)) * 3
    on_cpu, on_cuda = run(logits, rows), run(logits, rows, cuda)
    assert on_cpu[0] == on_cuda[0]
    for want, got in zip(on_cpu[1], on_cuda[1]):
        assert_logprob_close(got, want, tol=1e-5)


STAT_LOGITS = torch.tensor([2.0, 1.6, 1.2, 0.9, 0.4, 0.0, -0.6, -2.0])  # [V = 8]
STAT_PARAMS = [
    SamplingParams(8, temperature=1.0),
    SamplingParams(8, temperature=0.7, top_k=5),
    SamplingParams(8, temperature=1.3, top_p=0.8),
    SamplingParams(8, temperature=0.9, top_k=6, top_p=0.9, presence_penalty=0.5, frequency_penalty=0.4),
    SamplingParams(8, temperature=1.2, min_p=0.2, top_p=0.95, logit_bias=((6, 1.5),)),
]
DRAWS = 20_000


@pytest.mark.parametrize("params", STAT_PARAMS)
@pytest.mark.parametrize("vary", ["seed", "step"])
def test_draws_follow_target_distribution(params: SamplingParams, vary: str) -> None:
    if vary == "seed":  # many requests at one step
        rows = [SamplingRow(params, seed, [1, 1, 4]) for seed in range(DRAWS)]
    else:  # one request's steps; without penalties its history only sets the step
        params = replace(params, presence_penalty=0.0, frequency_penalty=0.0)
        rows = [SamplingRow(params, 12345, range(step)) for step in range(DRAWS)]
    tokens, _ = run(STAT_LOGITS.expand(DRAWS, -1), rows)
    seen = Counter(tokens)
    probs = target_distribution(penalised(STAT_LOGITS, rows[0]), params)  # [V]
    support = [v for v in range(len(STAT_LOGITS)) if probs[v] > 0]
    assert set(seen) <= set(support)
    chi2 = sum((seen[v] - DRAWS * float(probs[v])) ** 2 / (DRAWS * float(probs[v])) for v in support)
    assert chi2 < chi_square_bound(len(support) - 1), (chi2, seen, probs)


def test_top_k_and_top_p_never_draw_outside_the_kept_set() -> None:
    rng = random.Random(6)
    gen = torch.Generator().manual_seed(7)
    rows = [SamplingRow(SamplingParams(8, temperature=rng.choice([0.5, 1.0, 3.0]), top_k=rng.choice([0, 1, 2, 7]),
                                       top_p=rng.choice([1.0, 0.5, 0.2]), presence_penalty=rng.choice([0.0, 1.0])),
                        rng.randrange(2**63), [rng.randrange(16) for _ in range(rng.randrange(5))])
            for _ in range(3000)]
    logits = torch.randn(len(rows), 16, generator=gen) * 2  # [B, V]
    tokens, _ = run(logits, rows)
    for b, row in enumerate(rows):
        assert target_distribution(penalised(logits[b], row), row.params)[tokens[b]] > 0


def chi_square_bound(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (z = 3.29: p = 0.9995)."""
    return df * (1 - 2 / (9 * df) + z * sqrt(2 / (9 * df))) ** 3


def assert_logprob_close(got: TokenLogprob | None, want: TokenLogprob | None, tol: float = 1e-6) -> None:
    if want is None or got is None:
        assert got is want
        return
    """Equal up to tol, and up to the order of tied alternatives (token_logprob's topk leaves it open)."""
    assert got.token_id == want.token_id and abs(got.logprob - want.logprob) <= tol
    assert len(got.top) == len(want.top) and len({t for t, _ in got.top}) == len(got.top)
    want_of = dict(want.top)
    for (token, value), (_, want_value) in zip(got.top, want.top):
        assert abs(value - want_value) <= tol  # the same values, best first
        # the same ids, but for ties at the cut-off
        assert abs(want_of.get(token, float("inf")) - value) <= tol or abs(value - want.top[-1][1]) <= tol


# vLLM's extras: logit_bias, min_p, repetition_penalty, min_tokens (over the stop tokens)

def extras_row(rng: random.Random, vocab: int = VOCAB) -> SamplingRow:
    """random_row with some of the extras; the prompt is what the repetition penalty also sees."""
    row = random_row(rng, vocab)
    params = replace(
        row.params, min_p=rng.choice([0.0, 0.0, 0.05, 0.5, 1.0]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.7]), min_tokens=rng.choice([0, 0, 3, 20]),
        stop_token_ids=tuple(rng.sample(range(vocab), rng.randrange(3))),
        logit_bias=tuple((t, rng.uniform(-100, 100)) for t in rng.sample(range(vocab), rng.choice([0, 0, 1, 4]))))
    return SamplingRow(params, row.seed, row.output_ids, [rng.randrange(vocab) for _ in range(rng.randrange(1, 9))])


def adjusted(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The per-sequence reference of what a row samples from, as decode.choose_token builds it."""
    penalised_logits = apply_penalties(logits, row.params, Counter(row.output_ids), row.prompt_ids)
    return forbid_stop_tokens(penalised_logits, row.params, len(row.output_ids))


def test_extras_greedy_and_logprobs_equal_choose_token() -> None:
    rng = random.Random(10)
    rows = [extras_row(rng) for _ in range(80)]
    rows = [SamplingRow(replace(r.params, temperature=0.0), r.seed, r.output_ids, r.prompt_ids) if i % 2 else r
            for i, r in enumerate(rows)]
    logits = torch.randn(len(rows), VOCAB, generator=torch.Generator().manual_seed(11)) * 3  # [B, V]
    tokens, logprobs = run(logits, rows)
    for b, row in enumerate(rows):
        seq = Sequence("r", list(row.prompt_ids), row.params, row.seed, output_ids=list(row.output_ids),
                       output_counts=Counter(row.output_ids))
        if row.params.temperature == 0:
            token, want = choose_token(seq, logits[b], torch.Generator())
            assert tokens[b] == token
        else:
            want = None if row.params.logprobs is None else token_logprob(adjusted(logits[b], row), tokens[b],
                                                                         row.params.logprobs)
            assert target_distribution(adjusted(logits[b], row), row.params)[tokens[b]] > 0
        assert_logprob_close(logprobs[b], want)


def test_extras_rows_sample_the_same_alone_and_leave_their_neighbours_alone() -> None:
    rng = random.Random(12)
    gen = torch.Generator().manual_seed(13)
    for _ in range(6):
        rows = [extras_row(rng) if rng.random() < 0.5 else random_row(rng) for _ in range(rng.randrange(2, 30))]
        logits = torch.round(torch.randn(len(rows), VOCAB, generator=gen) * 8) / 4  # [B, V], many ties
        batched = run(logits, rows)
        alone = [run(logits[b:b + 1], [row]) for b, row in enumerate(rows)]
        assert batched == ([tokens[0] for tokens, _ in alone], [logprobs[0] for _, logprobs in alone])


def test_a_batch_without_extras_builds_none_of_their_tensors() -> None:
    rows = [random_row(random.Random(seed)) for seed in range(20)]
    batch = SamplingBatch.build(rows, CPU)
    assert batch.bias_ids is batch.bias is batch.seen_ids is batch.repetition is batch.log_min_p is None
    reached = SamplingRow(SamplingParams(8, min_tokens=2, stop_token_ids=(1,)), 0, [5, 6])  # min_tokens met
    assert SamplingBatch.build([reached], CPU).bias_ids is None


def test_logit_bias_and_min_tokens_decide_greedy_tokens() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 0] = 5.0  # token 0 is the EOS the model wants
    params = SamplingParams(8, temperature=0.0, stop_token_ids=(0,), min_tokens=2)
    rows = [SamplingRow(params, 0, [3]),  # below min_tokens: EOS banned, even biased up
            SamplingRow(replace(params, logit_bias=((0, 100.0), (9, 4.0))), 0, [3]),
            SamplingRow(replace(params, logit_bias=((9, 100.0),)), 0, [3, 4])]  # reached: bias wins
    tokens, _ = run(logits, rows)
    assert tokens[0] != 0 and tokens[1] == 9 and tokens[2] == 9


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    row = SamplingRow(SamplingParams(8, temperature=0.0, repetition_penalty=2.0, logprobs=4), 0, [1], [0])
    _, [logprob] = run(logits, [row])
    want = torch.log_softmax(torch.tensor([1.0, -4.0, 2.0, -2.0, 1.0]), -1)  # 0 from the prompt, 1 generated
    assert logprob.token_id == 2 and dict(logprob.top) == pytest.approx({i: float(want[i]) for i in (2, 0, 4, 3)})


def test_min_p_keeps_only_tokens_near_the_best() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08])).expand(400, -1)  # [B, V]
    rows = [SamplingRow(SamplingParams(8, temperature=1.0, min_p=0.5), seed, []) for seed in range(400)]
    tokens, _ = run(logits, rows)
    assert set(tokens) == {0, 1}  # 0.12 < 0.5 * 0.5


def test_draft_verify_honours_the_extras_it_applies() -> None:
    assert draft_verify_honours(SamplingParams(8, logit_bias=((1, 2.0),), min_p=0.1), 0)
    assert not draft_verify_honours(SamplingParams(8, repetition_penalty=1.1), 50)
    assert not draft_verify_honours(SamplingParams(8, min_tokens=4), 3)
    assert draft_verify_honours(SamplingParams(8, min_tokens=4), 4)


def test_grammar_mask_restricts_only_its_rows_and_leaves_logprobs_to_the_model() -> None:
    rng = random.Random(3)
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    rows = [random_row(rng) for _ in range(4)]
    rows[1] = replace(rows[1], params=replace(rows[1].params, temperature=1.0, logprobs=2))
    rows[2] = replace(rows[2], params=replace(rows[2].params, temperature=0.0, logprobs=2))
    allowed = {1: [5, 31, 32, 47], 2: [0, 40]}  # both sides of a 32-bit word boundary, and the last id
    for seed in range(20):
        rows[1] = replace(rows[1], seed=seed)
        batch = SamplingBatch.build(rows, CPU)
        free_tokens, free_logprobs = sample(logits, batch).to_host()
        mask = token_mask(allowed, rows=4, vocab=VOCAB)
        tokens, logprobs = sample(logits, batch, lambda: mask).to_host()
        assert tokens[1] in allowed[1] and tokens[2] in allowed[2]
        assert tokens[2] == max(allowed[2], key=lambda t: penalised(logits[2], rows[2])[t].item())
        assert [tokens[0], tokens[3]] == [free_tokens[0], free_tokens[3]]  # other rows: untouched
        assert [lp.top for lp in logprobs[1:3]] == [lp.top for lp in free_logprobs[1:3]]  # the model's own
    greedy = [replace(row, params=SamplingParams(max_tokens=8, temperature=0)) for row in rows]
    mask = token_mask({0: [7], 3: [9, 10]}, rows=4, vocab=VOCAB)
    fast = sample(logits.bfloat16(), SamplingBatch.build(greedy, CPU), lambda: mask)
    assert fast.tokens[0] == 7 and fast.tokens[3] in (9, 10)  # the greedy-only path applies it too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_extras_cpu_and_cuda_agree() -> None:
    rng = random.Random(14)
    rows = [extras_row(rng, vocab=4096) for _ in range(256)]
    logits = torch.randn(len(rows), 4096, generator=torch.Generator().manual_seed(15)) * 3  # [B, V]
    on_cpu, on_cuda = run(logits, rows), run(logits, rows, torch.device("cuda"))
    assert on_cpu[0] == on_cuda[0]
    for want, got in zip(on_cpu[1], on_cuda[1]):
        assert_logprob_close(got, want, tol=1e-5)
