"""Per-position acceptance: greedy agreement and the exact distribution of speculative sampling."""
from __future__ import annotations

import torch

from moe_serve.engine.sampling import draw
from moe_serve.engine.speculative.acceptance import AcceptRule, verify_position

LOSSLESS = AcceptRule(greedy=False)


def _toy_pair() -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and draft q over 6 tokens, with zeros on both sides as top-k/top-p leave them."""
    p = torch.tensor([0.40, 0.25, 0.20, 0.15, 0.00, 0.00])
    q = torch.tensor([0.10, 0.30, 0.00, 0.30, 0.20, 0.10])
    return p, q


def _one_position(p: torch.Tensor, q: torch.Tensor, rule: AcceptRule, generator: torch.Generator) -> int:
    token, _ = verify_position(p, q, draw(q, generator), rule, generator)
    return token


def _histogram(rule: AcceptRule, samples: int, seed: int) -> torch.Tensor:
    p, q = _toy_pair()
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p.shape[0])
    for _ in range(samples):
        counts[_one_position(p, q, rule, generator)] += 1
    return counts


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson statistic over the categories the reference gives mass to."""
    expected = probs * counts.sum()
    support = probs > 0
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def test_greedy_keeps_exactly_the_target_argmax() -> None:
    p = torch.nn.functional.one_hot(torch.tensor(3), 6).float()
    q = torch.nn.functional.one_hot(torch.tensor(3), 6).float()
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    assert verify_position(p, q, 3, AcceptRule(greedy=True), generator) == (3, True)
    assert verify_position(p, q, 1, AcceptRule(greedy=True), generator) == (3, False)
    assert torch.equal(generator.get_state(), state), "greedy verification must not consume random numbers"


def test_speculative_sampling_matches_the_target_distribution() -> None:
    p, _ = _toy_pair()
    samples = 40_000
    counts = _histogram(LOSSLESS, samples, seed=1234)
    assert counts[p == 0].sum() == 0, "a token the target truncated away was emitted"
    total_variation = 0.5 * float((counts / samples - p).abs().sum())
    assert total_variation < 0.01
    # 3 degrees of freedom (4 supported tokens): 16.27 is the 0.999 quantile
    assert _chi_square(counts, p) < 16.27


def test_rejection_draws_from_the_residual() -> None:
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.0, 0.5, 0.5])
    generator = torch.Generator().manual_seed(0)
    # the draft proposed token 2, which the target never emits: always rejected, and p - q puts
    # all residual mass on token 0
    assert all(verify_position(p, q, 2, LOSSLESS, generator) == (0, False) for _ in range(50))


def test_adaptive_rule_keeps_close_confident_drafts_that_the_lossless_test_may_reject() -> None:
    p = torch.tensor([0.55, 0.45])
    q = torch.tensor([0.60, 0.40])
    adaptive = AcceptRule(greedy=False, confidence=0.5, tolerance=0.1)
    generator = torch.Generator().manual_seed(0)
    assert all(verify_position(p, q, 0, adaptive, generator) == (0, True) for _ in range(200))
    assert not adaptive.lossless and LOSSLESS.lossless
    kept_lossless = sum(verify_position(p, q, 0, LOSSLESS, generator)[1] for _ in range(2000))
    assert kept_lossless < 2000  # p/q = 0.92: the lossless test rejects about 8%
