"""Adaptive draft length: expected-tokens model and its moving estimates."""
from __future__ import annotations

import pytest

from moe_serve.engine.speculative.adaptive import (
    AdaptiveGamma,
    AdaptiveGammaConfig,
    best_gamma,
    expected_tokens,
)


def test_expected_tokens_matches_the_geometric_sum() -> None:
    assert expected_tokens(0.5, 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0


def test_best_gamma_grows_with_acceptance_and_shrinks_with_draft_cost() -> None:
    assert best_gamma(0.95, draft_cost=0.05, verify_cost=1.0, gamma_max=8) == 8
    assert best_gamma(0.1, draft_cost=0.5, verify_cost=1.0, gamma_max=8) == 1
    cheap = best_gamma(0.7, draft_cost=0.05, verify_cost=1.0, gamma_max=8)
    dear = best_gamma(0.7, draft_cost=0.4, verify_cost=1.0, gamma_max=8)
    assert cheap > dear >= 1


def test_rejections_shorten_and_acceptances_lengthen_the_draft() -> None:
    adaptive = AdaptiveGamma(AdaptiveGammaConfig(gamma_max=8, initial_acceptance=0.7))
    start = adaptive.gamma
    for _ in range(10):
        adaptive.update(drafted=4, accepted=0, draft_seconds=0.4, verify_seconds=1.0)
    assert adaptive.alpha < 0.1 and adaptive.gamma < start
    for _ in range(30):
        adaptive.update(drafted=4, accepted=4, draft_seconds=0.4, verify_seconds=1.0)
    assert adaptive.alpha > 0.9 and adaptive.gamma > start
    adaptive.reset()
    assert adaptive.alpha == 0.7 and adaptive.seconds_per_verify == pytest.approx(1.0)


def test_a_round_without_drafts_changes_nothing() -> None:
    adaptive = AdaptiveGamma(AdaptiveGammaConfig(gamma_max=4))
    adaptive.update(drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=1.0)
    assert adaptive.alpha == 0.7 and adaptive.seconds_per_verify is None
