"""SpecSwitch: who speculates, from measured costs (no torch)."""
from __future__ import annotations

from moe_serve.engine.speculative.switch import MEASURED_STEPS, PROBE_EVERY, PROBE_STEPS, SpecSwitch


def lone_step(switch: SpecSwitch, spec_round: tuple[float, int], plain_step: tuple[float, int]) -> bool:
    """One lone step: ask, then report what that mode cost (seconds, tokens)."""
    mode = switch.speculate(running=1, waiting=0)
    switch.record(mode, *(spec_round if mode else plain_step))
    return mode


def test_only_a_sequence_alone_with_nothing_waiting_speculates():
    switch = SpecSwitch()
    assert not switch.speculate(running=2, waiting=0)
    assert not switch.speculate(running=1, waiting=3)
    assert switch.speculate(running=1, waiting=0)


def test_each_mode_is_measured_over_a_window_then_the_cheaper_one_wins_with_periodic_probes():
    switch = SpecSwitch()
    modes = [lone_step(switch, (0.010, 4), (0.004, 1)) for _ in range(2 * PROBE_STEPS)]
    # speculation first, then plain decoding, each for its window (2.5 vs 4 ms per token)
    assert modes == [True] * PROBE_STEPS + [False] * PROBE_STEPS
    # plain decoding is re-measured after every PROBE_EVERY steps of speculation...
    choices = [lone_step(switch, (0.010, 4), (0.004, 1)) for _ in range(2 * (PROBE_EVERY + PROBE_STEPS - 1))]
    assert choices.count(False) == 2 * PROBE_STEPS
    first_probe = choices.index(False)
    assert choices[first_probe:first_probe + PROBE_STEPS] == [False] * PROBE_STEPS  # ...for a whole window


def test_the_first_step_after_a_change_of_mode_is_not_counted():
    """It pays for the change (draft catch-up, KV copies, a cold cache): 1 s here, which would
    make speculation lose if it counted."""
    switch = SpecSwitch()
    for step in range(PROBE_STEPS):
        assert switch.speculate(1, 0)
        switch.record(True, seconds=1.0 if step == 0 else 0.010, tokens=4)
    assert switch.speculative.steps == MEASURED_STEPS
    assert abs(switch.speculative.seconds_per_token - 0.0025) < 1e-12
    switch.record(None, seconds=0.5, tokens=3)  # a batched step: the next lone step pays for it
    switch.record(True, seconds=2.0, tokens=1)
    assert switch.speculative.steps == MEASURED_STEPS


def test_a_mode_costs_its_seconds_over_its_tokens_not_the_mean_of_its_rounds_ratios():
    """Acceptance swings from round to round: rounds of 2 and 13 tokens at 0.26 s each cost
    0.52 s for 15 tokens (35 ms per token), not the mean of 130 and 20 ms (75 ms)."""
    switch = SpecSwitch(smoothing=0.5)
    switch.record(True, 0.26, 2)  # not counted: the first
    switch.record(True, 0.26, 2)
    switch.record(True, 0.26, 13)
    assert abs(switch.speculative.seconds_per_token - 0.26 / 7.5) < 1e-12


def test_a_draft_that_stops_paying_loses_the_lone_sequence():
    switch = SpecSwitch()
    for _ in range(2 * PROBE_STEPS):
        lone_step(switch, (0.002, 1), (0.003, 1))
    for _ in range(20):  # acceptance collapses: each round now costs 8 ms for one token
        switch.record(True, seconds=0.008, tokens=1)
    decisions = [switch.speculate(1, 0) for _ in range(PROBE_EVERY - 1)]
    assert decisions.count(True) == 0


def test_a_step_that_emitted_nothing_teaches_nothing():
    switch = SpecSwitch()
    switch.record(True, seconds=1.0, tokens=0)
    switch.record(True, seconds=1.0, tokens=0)
    assert switch.speculative.steps == 0 and switch.speculative.seconds_per_token is None
