"""Speculative counters count what their names say."""
from __future__ import annotations

from moe_serve.engine.speculative.stats import SpecStats


def test_acceptance_counters_and_position_histogram() -> None:
    stats = SpecStats()
    stats.record_verify(drafted=4, accepted=2, draft_seconds=0.1, verify_seconds=0.2)
    stats.record_verify(drafted=3, accepted=3, draft_seconds=0.1, verify_seconds=0.2)
    stats.record_verify(drafted=0, accepted=0, draft_seconds=0.0, verify_seconds=0.2)
    assert (stats.drafts, stats.draft_tokens, stats.accepted_tokens, stats.verify_steps) == (2, 7, 5, 3)
    assert stats.accepted_at_position == [2, 2, 1]
    assert stats.acceptance_rate == 5 / 7
    assert stats.mean_accepted_length == 2.5


def test_predictor_accuracy_per_layer() -> None:
    stats = SpecStats()
    stats.record_prediction(1, predicted={1, 2, 3}, needed={2, 3, 4, 5})
    stats.record_prediction(1, predicted={7}, needed={7})
    assert stats.predictor_accuracy_per_layer == [0.0, 3 / 5]
