"""When the engine speculates (plain Python, no torch).

A step whose every sequence is decoding (none prefilling, none constrained by a grammar) can
draft and verify instead of decoding plainly: alone (moe_serve/engine/speculative/loop.py) or as a
batch (batched.py). Whether that pays depends on the batch: one sequence's verify pass of gamma + 1
tokens is nearly as cheap as a decode step when the model is memory- or launch-bound, while at 32
sequences the verify pass is 32 x (gamma + 1) tokens of compute (and, with experts offloaded, of
nearly every expert of each layer), where a plain step of 32 tokens already shares each expert
copy. So the choice is made per batch-size bucket (1, 2, 3-4, 5-8, ...), each from its own
measurements: a bucket speculates while its measured seconds per token beat plain decoding's in
that bucket. A draft that keeps missing (code the draft never saw, a high temperature, experts too
costly to verify many tokens) then costs little. The losing mode is re-measured for PROBE_STEPS
steps now and then, since acceptance and step costs drift with the context: as soon as the winner's
steps since the last measurement took PROBE_STEPS of the loser's steps over PROBE_TAX, so
re-measuring costs at most about PROBE_TAX of that bucket's time whatever the two modes cost. A
fixed count of steps did not: at Mixtral-size experts (25% budget, bf16) a verify round of 13
tokens needs nearly every expert (~300 ms and more, against a 55 ms plain step), and a window
every 32 plain steps made the engine decode a lone sequence at 10 tok/s against 17.9 plain: 48
tokens in 4.8 s, of which 5 verify rounds took ~3 s (bench/results/batch/batch-mixtral-25-spec-draft.json).

Why windows and not single steps. The first step of a mode after another kind of step (the other
mode, another bucket, a prefill) pays for the change (the draft catching up on the tokens decoded
meanwhile, the KV copied between the paged cache and the lone decoder's, a cold expert cache for a
verify's many tokens), so it is never counted. And one round's tokens swing with acceptance (2 to
13 of 13 in a run on the H100), so a mode's cost is a ratio of sums, its seconds over its tokens,
never one round's ratio alone: measured at Mixtral-size experts (25% budget, bf16), probes of one
step each, first step counted, kept the engine decoding plainly at 53 ms/token while speculation
gave 35.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE_STEPS = 4  # steps a measurement runs a mode for; its first is not counted
PROBE_TAX = 0.1  # re-measuring the losing mode takes at most about this share of a bucket's time
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


def batch_bucket(batch: int) -> int:
    """The bucket a batch of `batch` decoding sequences is measured in: the next power of two."""
    return 1 << (batch - 1).bit_length()


@dataclass
class _Choice:
    """One bucket's two modes, measured, and its re-measurement of the loser."""

    speculative: _Cost = field(default_factory=_Cost)
    plain: _Cost = field(default_factory=_Cost)
    winner_seconds: float = 0.0  # the winning mode's steps since the last measurement of the other
    probe_left: int = 0  # steps left of the losing mode's current measurement
    probe_mode: bool = False  # the mode being re-measured

    def speculate(self) -> bool:
        if not self.measured:
            return self.current()  # measure speculation first, then plain decoding
        if self.probe_left:
            self.probe_left -= 1
            return self.probe_mode
        winner = self.winner()
        loser = self.plain if winner else self.speculative
        if self.winner_seconds * PROBE_TAX >= PROBE_STEPS * loser.seconds:  # seconds: its mean step
            self.winner_seconds = 0.0
            self.probe_mode, self.probe_left = not winner, PROBE_STEPS - 1
            return self.probe_mode
        return winner

    def current(self) -> bool:
        """speculate()'s answer without the probes: it changes nothing."""
        for mode, cost in ((True, self.speculative), (False, self.plain)):
            if cost.steps < MEASURED_STEPS:
                return mode
        return self.winner()

    def record(self, speculated: bool, seconds: float, tokens: int, counted: bool, smoothing: float) -> None:
        if counted:
            (self.speculative if speculated else self.plain).update(seconds, tokens, smoothing)
        if self.measured and speculated == self.winner():
            self.winner_seconds += seconds

    @property
    def measured(self) -> bool:
        return self.speculative.steps >= MEASURED_STEPS and self.plain.steps >= MEASURED_STEPS

    def winner(self) -> bool:
        spec, plain = self.speculative.seconds_per_token, self.plain.seconds_per_token
        return spec is not None and plain is not None and spec <= plain


@dataclass
class SpecSwitch:
    smoothing: float = 0.25  # weight of the newest counted step in the sums
    always: bool = False  # --spec-switch always: every step that may speculate does, measured or not
    buckets: dict[int, _Choice] = field(default_factory=dict)
    _previous: tuple[int, bool] | None = None  # the last step's (bucket, mode); None if it could not speculate

    def speculate(self, batch: int) -> bool:
        """Whether this step's `batch` decoding sequences speculate (call once per step that could)."""
        return self.always or self.choice(batch).speculate()

    def prefers(self, batch: int) -> bool:
        """The bucket's current mode without its probes, changing nothing, for a step whose prefill
        chunks would spoil a measurement (it is recorded as one that could not speculate): each mode
        while it is being measured, speculation first, then the winner."""
        return self.always or self.choice(batch).current()

    def record(self, batch: int | None, speculated: bool, seconds: float, tokens: int) -> None:
        """Every step: the decoding sequences that could have speculated (None: the step could not)
        and whether they did, with its wall time and the tokens it emitted. A step whose predecessor
        was of another kind paid for the change and is not counted."""
        key = None if batch is None else (batch_bucket(batch), speculated)
        counted = key is not None and key == self._previous and tokens > 0
        self._previous = key
        if batch is not None:
            self.choice(batch).record(speculated, seconds, tokens, counted, self.smoothing)

    def choice(self, batch: int) -> _Choice:
        """The measurements of batch's bucket."""
        return self.buckets.setdefault(batch_bucket(batch), _Choice())
