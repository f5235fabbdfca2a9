"""Settings of speculative decoding, fixed at start-up."""
from __future__ import annotations

from dataclasses import dataclass

from moe_serve.engine.config import EngineConfig


@dataclass(frozen=True)
class SpecConfig:
    gamma: int = 8  # most tokens drafted per verify pass (EngineConfig.spec_tokens)
    top_r: int = 1  # experts per MoE layer the self-draft routes to (SS-MoE r)
    confidence: float = 0.0  # tau: stop drafting once the draft's max probability falls below it
    cutoff: int | None = None  # leading target MoE layers to prefetch while drafting; None: profiled
    adaptive_tolerance: float | None = None  # SS-MoE T: lossy adaptive acceptance, opt-in only
    adaptive_gamma: bool = False  # per-request gamma in [1, gamma] from the acceptance history

    def __post_init__(self) -> None:
        if self.gamma < 1:
            raise ValueError(f"spec_tokens must be >= 1, got {self.gamma}")
        if self.top_r < 1:
            raise ValueError(f"spec_top_r must be >= 1, got {self.top_r}")
        if not 0.0 <= self.confidence <= 1.0:
            raise ValueError(f"spec_confidence must be in [0, 1], got {self.confidence}")
        if self.cutoff is not None and self.cutoff < 0:
            raise ValueError(f"spec_cutoff must be >= 0, got {self.cutoff}")
        if self.adaptive_tolerance is not None and not 0.0 <= self.adaptive_tolerance <= 1.0:
            raise ValueError(f"spec_adaptive_accept must be in [0, 1], got {self.adaptive_tolerance}")

    @classmethod
    def from_engine(cls, config: EngineConfig) -> SpecConfig:
        return cls(gamma=config.spec_tokens, top_r=config.spec_top_r, confidence=config.spec_confidence,
                   cutoff=config.spec_cutoff, adaptive_tolerance=config.spec_adaptive_accept,
                   adaptive_gamma=config.spec_adaptive_tokens)
