"""When the engine speculates (plain Python, no torch).

Draft/verify runs one sequence (it is not batched), so only a sequence decoding alone with
nothing waiting can speculate; any other step decodes every running sequence in one batched
forward, which shares each expert copy among them. A lone sequence speculates while its
measured seconds per token beat plain decoding's at batch 1: a draft that keeps missing (code
the draft never saw, a high temperature) then costs nothing. The losing mode is re-measured
every PROBE_EVERY lone steps, since acceptance and step costs drift with the context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

PROBE_EVERY = 32


@dataclass
class _Cost:
    seconds_per_token: float | None = None
    steps: int = 0

    def update(self, seconds: float, tokens: int, smoothing: float) -> None:
        self.steps += 1
        if self.steps == 1:
            return  # a mode's first step compiles kernels and captures graphs: not its cost
        sample = seconds / tokens
        old = self.seconds_per_token
        self.seconds_per_token = sample if old is None else (1 - smoothing) * old + smoothing * sample


@dataclass
class SpecSwitch:
    smoothing: float = 0.25  # weight of the newest step in the moving averages
    speculative: _Cost = field(default_factory=_Cost)
    plain: _Cost = field(default_factory=_Cost)
    lone_steps: int = 0

    def speculate(self, running: int, waiting: int) -> bool:
        """Whether this step's lone sequence speculates (call once per step that could)."""
        if running != 1 or waiting:
            return False
        self.lone_steps += 1
        spec, plain = self.speculative.seconds_per_token, self.plain.seconds_per_token
        if spec is None or plain is None:
            return spec is None  # measure speculation first, then plain decoding
        winner = spec <= plain
        return winner != (self.lone_steps % PROBE_EVERY == 0)

    def record(self, speculated: bool, seconds: float, tokens: int) -> None:
        """A lone sequence's step: its wall time and the tokens it emitted."""
        if tokens > 0:
            (self.speculative if speculated else self.plain).update(seconds, tokens, self.smoothing)
