"""Counters of speculative decoding, cumulative over the engine's life (plain Python, no torch)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    drafts: int = 0  # draft phases that proposed at least one token
    draft_tokens: int = 0  # tokens proposed by the draft
    accepted_tokens: int = 0  # drafted tokens the target kept
    accepted_at_position: list[int] = field(default_factory=list)  # [i]: times draft position i was kept
    verify_steps: int = 0  # target forwards over pending + drafts (prefill excluded)
    predicted_needed_per_layer: list[int] = field(default_factory=list)  # [l]: needed experts that were predicted
    needed_per_layer: list[int] = field(default_factory=list)  # [l]: experts the verify pass routed to
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record_verify(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """One draft/verify round: `accepted` of `drafted` tokens kept (the bonus token is not counted)."""
        self.verify_steps += 1
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        if drafted == 0:
            return
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        _grow(self.accepted_at_position, accepted)
        for position in range(accepted):
            self.accepted_at_position[position] += 1

    def record_prediction(self, layer: int, predicted: set[int], needed: set[int]) -> None:
        """Predictor outcome for one target MoE layer of one verify pass."""
        _grow(self.needed_per_layer, layer + 1)
        _grow(self.predicted_needed_per_layer, layer + 1)
        self.needed_per_layer[layer] += len(needed)
        self.predicted_needed_per_layer[layer] += len(predicted & needed)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafted tokens the target kept."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Drafted tokens kept per draft phase (add one for tokens emitted per verify)."""
        return self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def predictor_accuracy_per_layer(self) -> list[float]:
        """|predicted ∩ needed| / |needed| per target MoE layer (0 where nothing was needed)."""
        return [hit / need if need else 0.0 for hit, need in zip(self.predicted_needed_per_layer, self.needed_per_layer)]


def _grow(counts: list[int], size: int) -> None:
    counts.extend([0] * (size - len(counts)))
