"""When the engine speculates (plain Python, no torch).

Draft/verify runs one sequence (it is not batched), so only a sequence decoding alone with
nothing waiting can speculate; any other step decodes every running sequence in one batched
forward, which shares each expert copy among them. A lone sequence speculates while its
measured seconds per token beat plain decoding's at batch 1: a draft that keeps missing (code
the draft never saw, a high temperature, experts too costly to verify many tokens) then costs
little. The losing mode is re-measured for PROBE_STEPS steps now and then, since acceptance and
step costs drift with the context: as soon as the winner's lone steps since the last measurement
took PROBE_STEPS of the loser's steps over PROBE_TAX, so re-measuring costs at most about PROBE_TAX
of a lone sequence's time whatever the two modes cost. A fixed count of steps did not: at
Mixtral-size experts (25% budget, bf16) a verify round of 13 tokens needs nearly every expert
(~300 ms and more, against a 55 ms plain step), and a window every 32 plain steps made the engine
decode a lone sequence at 10 tok/s against 17.9 plain: 48 tokens in 4.8 s, of which 5 verify
rounds took ~3 s (bench/results/batch/batch-mixtral-25-spec-draft.json).

Why windows and not single steps. The first step of a mode after another kind of step pays for
the change (the draft catching up on the tokens decoded meanwhile, the KV copied between the
paged cache and the decoder's, a cold expert cache for a verify's many tokens), so it is never
counted. And one round's tokens swing with acceptance (2 to 13 of 13 in a run on the H100), so
a mode's cost is a ratio of sums, its seconds over its tokens, never one round's ratio alone:
measured at Mixtral-size experts (25% budget, bf16), probes of one step each, first step counted,
kept the engine decoding plainly at 53 ms/token while speculation gave 35.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE_STEPS = 4  # steps a measurement runs a mode for; its first is not counted
PROBE_TAX = 0.1  # re-measuring the losing mode takes at most about this share of lone decoding's time
MEASURED_STEPS = PROBE_STEPS - 1  # counted steps each mode needs before the first choice


@dataclass
class _Cost:
    """Exponentially weighted means of a mode's counted steps: seconds and tokens per step."""

    seconds: float = 0.0
    tokens: float = 0.0
    steps: int = 0

    def update(self, seconds: float, tokens: int, smoothing: float) -> None:
        new = smoothing if self.steps else 1.0  # the first step is the whole sum
        self.seconds = (1.0 - new) * self.seconds + new * seconds
        self.tokens = (1.0 - new) * self.tokens + new * tokens
        self.steps += 1

    @property
    def seconds_per_token(self) -> float | None:
        return self.seconds / self.tokens if self.steps else None


@dataclass
class SpecSwitch:
    smoothing: float = 0.25  # weight of the newest counted step in the sums
    speculative: _Cost = field(default_factory=_Cost)
    plain: _Cost = field(default_factory=_Cost)
    winner_seconds: float = 0.0  # the winning mode's lone steps since the last measurement of the other
    probe_left: int = 0  # steps left of the losing mode's current measurement
    probe_mode: bool = False  # the mode being re-measured
    _previous: bool | None = None  # the last step's mode if it was a lone step, None after a batched one

    def speculate(self, running: int, waiting: int) -> bool:
        """Whether this step's lone sequence speculates (call once per step that could)."""
        if running != 1 or waiting:
            return False
        for mode, cost in ((True, self.speculative), (False, self.plain)):
            if cost.steps < MEASURED_STEPS:
                return mode  # measure speculation first, then plain decoding
        if self.probe_left:
            self.probe_left -= 1
            return self.probe_mode
        winner = self._winner()
        loser = self.plain if winner else self.speculative
        if self.winner_seconds * PROBE_TAX >= PROBE_STEPS * loser.seconds:  # seconds: its mean step
            self.winner_seconds = 0.0
            self.probe_mode, self.probe_left = not winner, PROBE_STEPS - 1
            return self.probe_mode
        return winner

    def record(self, mode: bool | None, seconds: float, tokens: int) -> None:
        """Every step: mode True / False for a lone sequence's speculative / plain step, with its wall
        time and the tokens it emitted; None for a batched step. A step whose predecessor ran another
        mode, or a batch, paid for the change and is not counted."""
        counted = mode is not None and mode == self._previous and tokens > 0
        self._previous = mode
        if counted:
            (self.speculative if mode else self.plain).update(seconds, tokens, self.smoothing)
        if mode is not None and self._measured and mode == self._winner():
            self.winner_seconds += seconds

    @property
    def _measured(self) -> bool:
        return self.speculative.steps >= MEASURED_STEPS and self.plain.steps >= MEASURED_STEPS

    def _winner(self) -> bool:
        spec, plain = self.speculative.seconds_per_token, self.plain.seconds_per_token
        return spec is not None and plain is not None and spec <= plain
