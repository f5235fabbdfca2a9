"""Random experts encoded into cache-slot rows of any format, for the kernel tests."""
from __future__ import annotations

import torch

from moe_serve.engine.experts.layout import ExpertLayout


def random_slots(layout: ExpertLayout, num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """num_slots experts with weights ~ N(0, 1/fan_in), encoded in the layout's format: [S, numel]."""
    h, i = layout.hidden_size, layout.intermediate_size
    slots = torch.zeros(num_slots, layout.numel, dtype=layout.row_dtype)
    layout.write(slots, "gate_up", torch.randn(num_slots, 2 * i, h, generator=gen) / h**0.5)
    layout.write(slots, "down", torch.randn(num_slots, h, i, generator=gen) / i**0.5)
    return slots
