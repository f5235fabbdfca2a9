"""SpecSwitch: who speculates, from measured costs (no torch)."""
from __future__ import annotations

from moe_serve.engine.speculative.switch import PROBE_EVERY, SpecSwitch


def test_only_a_sequence_alone_with_nothing_waiting_speculates():
    switch = SpecSwitch()
    assert not switch.speculate(running=2, waiting=0)
    assert not switch.speculate(running=1, waiting=3)
    assert switch.speculate(running=1, waiting=0)


def test_each_mode_is_measured_then_the_cheaper_one_wins_with_periodic_probes():
    switch = SpecSwitch()
    for seconds in (1.0, 0.010):  # the first step of a mode captures its graphs and does not count
        assert switch.speculate(1, 0)
        switch.record(True, seconds=seconds, tokens=4)  # then 2.5 ms per token
    for seconds in (1.0, 0.004):
        assert not switch.speculate(1, 0)  # then plain decoding is measured
        switch.record(False, seconds=seconds, tokens=1)  # 4 ms per token
    choices = []
    for _ in range(2 * PROBE_EVERY):
        choices.append(switch.speculate(1, 0))
    assert choices.count(False) == 2  # speculation wins; plain decoding is re-measured every PROBE_EVERY steps


def test_a_draft_that_stops_paying_loses_the_lone_sequence():
    switch = SpecSwitch()
    for speculated, seconds in ((True, 0.002), (True, 0.002), (False, 0.003), (False, 0.003)):
        assert switch.speculate(1, 0) == speculated
        switch.record(speculated, seconds=seconds, tokens=1)
    for _ in range(20):  # acceptance collapses: each round now costs 8 ms for one token
        switch.record(True, seconds=0.008, tokens=1)
    decisions = [switch.speculate(1, 0) for _ in range(PROBE_EVERY - 1)]
    assert decisions.count(True) <= 1


def test_a_step_that_emitted_nothing_teaches_nothing():
    switch = SpecSwitch()
    switch.record(True, seconds=1.0, tokens=0)
    assert switch.speculative.steps == 0 and switch.speculative.seconds_per_token is None
