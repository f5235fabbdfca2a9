"""Which drafted tokens the target keeps, one position at a time.

With p the target's and q the draft's distribution at a position (both from
sampling.target_distribution over logits penalised with the running counts, so temperature,
top-k and top-p truncate both sides alike) and d the drafted token:

* temperature 0: keep d iff it is the target's argmax, else emit that argmax;
* temperature > 0: keep d with probability min(1, p(d)/q(d)), else draw from
  norm(max(0, p - q)) (Leviathan et al., 2023), so every emitted token is distributed exactly
  as plain sampling from p would give;
* after the last kept draft, the target's next row gives one more token drawn from p as plain
  decoding would (decode.choose_token).

SS-MoE's adaptive verification (tolerance T set) also keeps d when q(d) > tau and
p(d)/q(d) > 1 - T; positions it does not keep go through the lossless test above. It trades
exactness for acceptance: the output distribution is no longer p, so it is opt-in only.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.engine.sampling import draw


@dataclass(frozen=True)
class AcceptRule:
    greedy: bool  # temperature 0: compare argmaxes, draw no random numbers
    confidence: float = 0.0  # tau of the adaptive rule
    tolerance: float | None = None  # T of the adaptive rule; None keeps verification lossless

    @property
    def lossless(self) -> bool:
        return self.greedy or self.tolerance is None


def verify_position(p: torch.Tensor, q: torch.Tensor | None, draft: int, rule: AcceptRule,
                    generator: torch.Generator) -> tuple[int, bool]:
    """Return (token to emit, whether it is the draft) for one drafted position. p, q [V].

    Greedy reads only p's argmax, so p may be the target's penalised logits themselves and q None:
    building the one-hot distributions cost more host time than a drafted token's forward."""
    if rule.greedy:
        best = int(p.argmax())
        return best, best == draft
    assert q is not None, "speculative sampling needs the draft's distribution"
    if _adaptively_kept(float(p[draft]), float(q[draft]), rule):
        return draft, True
    # u < p/q written as u*q < p: no division, and p(d) >= q(d) always keeps
    if float(torch.rand((), generator=generator)) * float(q[draft]) < float(p[draft]):
        return draft, True
    return draw(_residual(p, q), generator), False


def _adaptively_kept(p_d: float, q_d: float, rule: AcceptRule) -> bool:
    return rule.tolerance is not None and q_d > rule.confidence and p_d > (1.0 - rule.tolerance) * q_d


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [V]; p itself when p <= q everywhere (only reachable through rounding)."""
    residual = (p - q).clamp_min(0.0)  # [V]
    total = residual.sum()
    return residual / total if total > 0 else p
