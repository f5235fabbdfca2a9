"""How one expert's SwiGLU weights are packed into a single contiguous row.

Packing gate, up and down into one row means one expert moves host->device in one copy and
occupies exactly one cache slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertLayout:
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def gate_up(self, row: torch.Tensor) -> torch.Tensor:
        """View of the fused gate+up projection, [2I, H] (gate rows first)."""
        i, h = self.intermediate_size, self.hidden_size
        return row[: 2 * i * h].view(2 * i, h)

    def down(self, row: torch.Tensor) -> torch.Tensor:
        """View of the down projection, [H, I]."""
        i, h = self.intermediate_size, self.hidden_size
        return row[2 * i * h :].view(h, i)

    def pack_into(self, row: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Write HF-shaped weights (gate/up [I, H], down [H, I]) into one packed row."""
        i = self.intermediate_size
        gate_up = self.gate_up(row)
        gate_up[:i].copy_(gate)
        gate_up[i:].copy_(up)
        self.down(row).copy_(down)
