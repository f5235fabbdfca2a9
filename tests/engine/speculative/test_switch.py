"""SpecSwitch: whether a step's decoding sequences speculate, from measured costs per batch-size bucket (no torch)."""
from __future__ import annotations

import pytest

from moe_serve.engine.speculative.switch import MEASURED_STEPS, PROBE_STEPS, PROBE_TAX, SpecSwitch, batch_bucket


def lone_step(switch: SpecSwitch, spec_round: tuple[float, int], plain_step: tuple[float, int], batch: int = 1) -> bool:
    """One step of `batch` decoding sequences: ask, then report what that mode cost (seconds, tokens)."""
    mode = switch.speculate(batch)
    switch.record(batch, mode, *(spec_round if mode else plain_step))
    return mode


def test_batch_sizes_are_measured_in_power_of_two_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 17, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 32, 64]


def test_each_bucket_chooses_from_its_own_measurements():
    """Speculation wins for one sequence and loses at 32 (its verify pass is 32 x (gamma + 1)
    tokens): each bucket settles on its own winner, and a batch of 20 uses the 32 bucket's."""
    switch = SpecSwitch()
    for _ in range(2 * PROBE_STEPS):
        lone_step(switch, (0.004, 4), (0.002, 1))
    for _ in range(2 * PROBE_STEPS):
        lone_step(switch, (0.200, 64), (0.004, 32), batch=32)
    assert switch.speculate(1) and not switch.speculate(20)
    assert switch.choice(1) is not switch.choice(32) and switch.choice(17) is switch.choice(32)


def test_each_mode_is_measured_over_a_window_then_the_cheaper_one_wins_with_periodic_probes():
    switch = SpecSwitch()
    modes = [lone_step(switch, (0.010, 4), (0.004, 1)) for _ in range(2 * PROBE_STEPS)]
    # speculation first, then plain decoding, each for its window (2.5 vs 4 ms per token)
    assert modes == [True] * PROBE_STEPS + [False] * PROBE_STEPS
    # plain decoding is re-measured once speculation's steps took PROBE_STEPS plain steps / PROBE_TAX...
    spacing = round(PROBE_STEPS * 0.004 / PROBE_TAX / 0.010)  # speculative steps between two probes
    choices = [lone_step(switch, (0.010, 4), (0.004, 1)) for _ in range(2 * (spacing + PROBE_STEPS))]
    assert choices.count(False) == 2 * PROBE_STEPS
    first_probe = choices.index(False)
    assert first_probe in (spacing, spacing + 1)  # float sums of step times
    assert choices[first_probe:first_probe + PROBE_STEPS] == [False] * PROBE_STEPS  # ...for a whole window


@pytest.mark.parametrize("spec_round,plain_step", [
    ((0.300, 2), (0.055, 1)),  # Mixtral-size bf16 experts at 25%: a 13-token verify needs every expert
    ((0.005, 4), (0.001, 1)),  # a host-bound small model where the draft pays
    ((0.002, 1), (0.030, 1)),
])
def test_re_measuring_the_loser_costs_at_most_about_probe_tax_of_the_time(spec_round, plain_step):
    """Whatever the two modes cost, probes of the loser take a bounded share of lone decoding."""
    switch = SpecSwitch()
    for _ in range(2 * PROBE_STEPS):
        lone_step(switch, spec_round, plain_step)
    winner = spec_round[0] / spec_round[1] <= plain_step[0] / plain_step[1]
    spent = {True: 0.0, False: 0.0}
    for _ in range(3000):
        mode = lone_step(switch, spec_round, plain_step)
        spent[mode] += (spec_round if mode else plain_step)[0]
    assert 0 < spent[not winner] <= 1.1 * PROBE_TAX * spent[winner]


def test_the_first_step_after_a_change_of_mode_is_not_counted():
    """It pays for the change (draft catch-up, KV copies, a cold cache): 1 s here, which would
    make speculation lose if it counted."""
    switch = SpecSwitch()
    for step in range(PROBE_STEPS):
        assert switch.speculate(1)
        switch.record(1, True, seconds=1.0 if step == 0 else 0.010, tokens=4)
    assert switch.choice(1).speculative.steps == MEASURED_STEPS
    assert abs(switch.choice(1).speculative.seconds_per_token - 0.0025) < 1e-12
    switch.record(None, False, seconds=0.5, tokens=3)  # a step that could not speculate: the next one pays
    switch.record(1, True, seconds=2.0, tokens=1)
    switch.record(3, True, seconds=0.1, tokens=4)  # another bucket: it pays for the change too
    switch.record(1, True, seconds=2.0, tokens=1)
    assert switch.choice(1).speculative.steps == MEASURED_STEPS
    assert switch.choice(3).speculative.steps == 0


def test_a_mode_costs_its_seconds_over_its_tokens_not_the_mean_of_its_rounds_ratios():
    """Acceptance swings from round to round: rounds of 2 and 13 tokens at 0.26 s each cost
    0.52 s for 15 tokens (35 ms per token), not the mean of 130 and 20 ms (75 ms)."""
    switch = SpecSwitch(smoothing=0.5)
    switch.record(1, True, 0.26, 2)  # not counted: the first
    switch.record(1, True, 0.26, 2)
    switch.record(1, True, 0.26, 13)
    assert abs(switch.choice(1).speculative.seconds_per_token - 0.26 / 7.5) < 1e-12


def test_a_draft_that_stops_paying_loses_the_lone_sequence():
    switch = SpecSwitch()
    for _ in range(2 * PROBE_STEPS):
        lone_step(switch, (0.002, 1), (0.003, 1))
    for _ in range(20):  # acceptance collapses: each round now costs 8 ms for one token
        switch.record(1, True, seconds=0.008, tokens=1)
    decisions = [switch.speculate(1) for _ in range(20)]
    assert decisions.count(True) == 0


def test_a_step_that_emitted_nothing_teaches_nothing():
    switch = SpecSwitch()
    switch.record(1, True, seconds=1.0, tokens=0)
    switch.record(1, True, seconds=1.0, tokens=0)
    assert switch.choice(1).speculative.steps == 0 and switch.choice(1).speculative.seconds_per_token is None


def test_prefers_follows_the_current_mode_and_changes_nothing():
    """Steps with prefill chunks riding along ask prefers: speculation while it is being measured,
    plain decoding while that is, then the winner, without spending the probes' countdown or
    adding to the measurements."""
    switch = SpecSwitch()
    assert switch.prefers(4)
    for _ in range(PROBE_STEPS):
        lone_step(switch, (0.004, 4), (0.002, 1), batch=4)
    assert not switch.prefers(4)  # speculation measured, plain decoding not yet
    for _ in range(PROBE_STEPS):
        lone_step(switch, (0.004, 4), (0.002, 1), batch=4)  # speculation wins at 4
    choice = switch.choice(4)
    before = (choice.speculative.steps, choice.plain.steps, choice.probe_left, choice.winner_seconds)
    assert all(switch.prefers(4) for _ in range(100))
    assert (choice.speculative.steps, choice.plain.steps, choice.probe_left, choice.winner_seconds) == before


def test_always_speculates_whatever_the_measurements_say():
    """--spec-switch always: plain decoding measured cheaper in every bucket, yet every step that may
    speculate does (the measurements still go on, for nothing)."""
    switch = SpecSwitch(always=True)
    assert all(lone_step(switch, (0.200, 2), (0.001, 1), batch) for batch in (1, 4, 32) for _ in range(50))
    assert switch.prefers(4) and switch.choice(4).speculative.steps == 49
