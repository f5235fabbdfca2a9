"""Per-request draft length from recent acceptance (off by default).

With per-token acceptance alpha, a round of gamma drafts emits on average
E(gamma) = (1 - alpha^(gamma+1)) / (1 - alpha) tokens (kept drafts plus the bonus token) and costs
c_draft * gamma + c_verify. The length used is the gamma in [1, gamma_max] with the most tokens per
unit cost; alpha is an exponential moving average of the observed per-position outcomes and the
costs of the measured seconds.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdaptiveGammaConfig:
    gamma_max: int
    decay: float = 0.8  # weight of the old estimate in each moving-average update
    initial_acceptance: float = 0.7
    initial_draft_cost_ratio: float = 0.2  # one drafted token / one verify pass, until measured


def expected_tokens(alpha: float, gamma: int) -> float:
    """Mean tokens one round emits: kept drafts plus the target's own token."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def best_gamma(alpha: float, draft_cost: float, verify_cost: float, gamma_max: int) -> int:
    """The gamma in [1, gamma_max] maximising expected tokens per unit of cost (ties: the shorter)."""
    return max(range(1, gamma_max + 1),
               key=lambda g: (expected_tokens(alpha, g) / (draft_cost * g + verify_cost), -g))


class AdaptiveGamma:
    """Moving estimates of acceptance and costs for the running request."""

    def __init__(self, config: AdaptiveGammaConfig) -> None:
        self.config = config
        self.alpha = config.initial_acceptance
        self.seconds_per_draft_token: float | None = None  # None until the first round is measured
        self.seconds_per_verify: float | None = None

    @property
    def gamma(self) -> int:
        if self.seconds_per_draft_token is None or self.seconds_per_verify is None:
            draft_cost, verify_cost = self.config.initial_draft_cost_ratio, 1.0
        else:
            draft_cost, verify_cost = self.seconds_per_draft_token, self.seconds_per_verify
        return best_gamma(self.alpha, draft_cost, verify_cost, self.config.gamma_max)

    def update(self, drafted: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """Fold in one round: positions 0..accepted-1 were kept, position `accepted` (if drafted) was not."""
        if drafted == 0:
            return
        for kept in [1.0] * accepted + [0.0] * (accepted < drafted):
            self.alpha = self._average(self.alpha, kept)
        self.seconds_per_draft_token = self._average(self.seconds_per_draft_token, draft_seconds / drafted)
        self.seconds_per_verify = self._average(self.seconds_per_verify, verify_seconds)

    def reset(self) -> None:
        """A new request starts from the prior acceptance; the measured costs are the hardware's and stay."""
        self.alpha = self.config.initial_acceptance

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else self.config.decay * old + (1.0 - self.config.decay) * new
