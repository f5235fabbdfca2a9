"""Every routed expert of the model in ONE host allocation [num_moe_layers, num_experts, layout.numel],
each expert one row in its layout's format (weights quantized at load, when the format asks).

Pinned when the compute device is CUDA, so a row copies to its GPU expert slot at full PCIe speed
and asynchronously; plain memory otherwise (pinning needs a CUDA driver).

Pinning registers our own allocation with cudaHostRegister instead of asking for pin_memory=True:
torch's caching host allocator rounds sizes up to a power of two, so a 90 GB store would ask for
128 GB of page-locked RAM.
"""
from __future__ import annotations

import weakref

import torch

from moe_serve.engine.experts.layout import ExpertLayout


class ExpertStore:
    def __init__(self, num_layers: int, num_experts: int, layout: ExpertLayout, *, pin: bool = False) -> None:
        self.layout = layout
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.rows = torch.empty((num_layers, num_experts, layout.numel), dtype=layout.row_dtype)  # [L_moe, E, numel]
        if pin and self.rows.numel():
            _pin(self, self.rows)

    @classmethod
    def for_device(cls, num_layers: int, num_experts: int, layout: ExpertLayout, device: torch.device | str) -> ExpertStore:
        pin = torch.device(device).type == "cuda" and torch.cuda.is_available()
        return cls(num_layers, num_experts, layout, pin=pin)

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    @property
    def is_pinned(self) -> bool:
        return self.rows.is_pinned()

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """The packed weights of one expert, [layout.numel] (a view into the store)."""
        return self.rows[layer, expert]

    def put(
        self,
        layer: int,
        expert: int,
        *,
        gate: torch.Tensor | None = None,
        up: torch.Tensor | None = None,
        down: torch.Tensor | None = None,
    ) -> None:
        """Write any of one expert's HF-shaped weights (gate/up [I, H], down [H, I]); the loader streams them one by one."""
        row = self.row(layer, expert)
        for part, src in (("gate", gate), ("up", up), ("down", down)):
            if src is not None:
                self.layout.write(row, part, src)

    def put_fused(self, layer: int, *, gate_up: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                  up: torch.Tensor | None = None, down: torch.Tensor | None = None) -> None:
        """Write all experts of a layer from 3-D tensors: transformers 5's fused gate_up [E, 2I, H] and
        down [E, H, I], or GGUF's gate and up [E, I, H] apart."""
        for part, src in (("gate_up", gate_up), ("gate", gate), ("up", up), ("down", down)):
            if src is None:
                continue
            if src.shape[0] != self.num_experts:
                raise ValueError(f"expert weight has {src.shape[0]} experts, expected {self.num_experts}")
            for expert, weights in enumerate(src):  # one expert at a time: encoding needs fp32 temporaries
                self.layout.write(self.row(layer, expert), part, weights)


    def put_encoded(self, layer: int, expert: int | None, part: str, data: torch.Tensor,
                    scales: torch.Tensor | None) -> None:
        """Write one part of one expert (or, expert None, of all experts of a layer: a leading [E] dim)
        already encoded in the layout's format, as a quantized checkpoint publishes it."""
        if expert is not None:
            self.layout.write_encoded(self.row(layer, expert), part, data, scales)
            return
        if data.shape[0] != self.num_experts:
            raise ValueError(f"expert weight has {data.shape[0]} experts, expected {self.num_experts}")
        for e in range(self.num_experts):
            self.layout.write_encoded(self.row(layer, e), part, data[e], None if scales is None else scales[e])


def _pin(owner: ExpertStore, rows: torch.Tensor) -> None:
    """Page-lock rows' memory for as long as owner lives."""
    cudart = torch.cuda.cudart()
    ptr = rows.data_ptr()
    err = cudart.cudaHostRegister(ptr, rows.numel() * rows.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the {rows.numel() * rows.element_size() / 2**30:.1f} GiB expert store failed ({err})")
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
