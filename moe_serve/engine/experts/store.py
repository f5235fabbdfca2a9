"""Every routed expert of the model in ONE host allocation [num_moe_layers, num_experts, numel],
each expert one row in its layer's layout (weights quantized at load, when the format asks).

Every layer shares one layout, except where a checkpoint publishes layers in different formats (a
GGUF Q4_K_M file keeps some layers' ffn_down in Q6_K): each layer then has its own, all of one
row dtype, and a row is as long as the largest (an expert slot holds any layer's expert). A
row() is the layer's own bytes, so a copy moves no padding.

Pinned when the compute device is CUDA, so a row copies to its GPU expert slot at full PCIe speed
and asynchronously; plain memory otherwise (pinning needs a CUDA driver). With a CUDA device, weights
that a quantized format encodes at load (--expert-quant) are encoded there, each part of an expert
copied up and its bytes back: elementwise work a GPU does in milliseconds, which took this
repository's 2-core host 0.3-0.9 s per 58.7M weights (int8 to q8_0), minutes for a Mixtral-8x7B-size
model.

Pinning registers our own allocation with cudaHostRegister instead of asking for pin_memory=True:
torch's caching host allocator rounds sizes up to a power of two, so a 90 GB store would ask for
128 GB of page-locked RAM.
"""
from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from moe_serve.engine.experts.layout import BIAS_SUFFIX, ExpertLayout


class ExpertStore:
    def __init__(self, num_layers: int, num_experts: int, layout: ExpertLayout | Sequence[ExpertLayout], *,
                 pin: bool = False, encode_on: torch.device | str | None = None) -> None:
        """layout: every layer's, or one per layer. encode_on: where put() quantizes weights (None:
        where they are)."""
        self.layouts = (layout,) * num_layers if isinstance(layout, ExpertLayout) else tuple(layout)
        if len(self.layouts) != num_layers:
            raise ValueError(f"{len(self.layouts)} expert layouts for {num_layers} MoE layers")
        if len({lay.row_dtype for lay in self.layouts}) > 1:
            raise ValueError("the layers' expert rows differ in element type: "
                             + ", ".join(sorted({lay.describe_formats() for lay in self.layouts})))
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.encode_on = None if encode_on is None else torch.device(encode_on)
        row_dtype = self.layouts[0].row_dtype if self.layouts else torch.uint8
        numel = max((lay.numel for lay in self.layouts), default=0)  # an expert slot's
        self.rows = torch.empty((num_layers, num_experts, numel), dtype=row_dtype)  # [L_moe, E, numel]
        if pin and self.rows.numel():
            _pin(self, self.rows)

    @classmethod
    def for_device(cls, num_layers: int, num_experts: int, layout: ExpertLayout | Sequence[ExpertLayout],
                   device: torch.device | str) -> ExpertStore:
        pin = torch.device(device).type == "cuda" and torch.cuda.is_available()
        return cls(num_layers, num_experts, layout, pin=pin, encode_on=device if pin else None)

    @property
    def layout(self) -> ExpertLayout:
        """The layout every layer shares; ValueError where layers differ (`layouts` then)."""
        if len(set(self.layouts)) != 1:
            raise ValueError(f"the layers' experts have different layouts: {self.describe_formats()}")
        return self.layouts[0]

    @property
    def row_numel(self) -> int:
        """Elements of an expert slot: the largest layer's row."""
        return self.rows.shape[-1]

    @property
    def row_dtype(self) -> torch.dtype:
        return self.rows.dtype

    @property
    def row_nbytes(self) -> int:
        """Bytes of an expert slot: the largest layer's row, what the cache budgets per expert."""
        return self.row_numel * self.rows.element_size()

    @property
    def format_name(self) -> str:
        """The experts' --expert-quant name, or the names of their formats joined: 'q4_k+q6_k'."""
        names = [fmt.name for layout in self.layouts for fmt in layout.formats]
        return "+".join(dict.fromkeys(names)) or "none"

    def describe(self) -> str:
        return f"{self.describe_formats()}, {self.row_nbytes} bytes per expert slot"

    def describe_formats(self) -> str:
        """The experts' format, or per distinct layout its layers: 'q4_k (layers 0, 2), q4_k with down
        q6_k (layers 1)'."""
        if len(set(self.layouts)) <= 1:
            return self.layouts[0].describe_formats() if self.layouts else "none"
        names = [layout.format_names for layout in self.layouts]
        return ", ".join(f"{name} (layers {', '.join(str(i) for i, n in enumerate(names) if n == name)})"
                         for name in dict.fromkeys(names))

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    @property
    def is_pinned(self) -> bool:
        return self.rows.is_pinned()

    def row(self, layer: int, expert: int) -> torch.Tensor:
        """The packed weights of one expert, [layouts[layer].numel] (a view into the store)."""
        return self.rows[layer, expert, :self.layouts[layer].numel]

    def put(
        self,
        layer: int,
        expert: int,
        *,
        gate: torch.Tensor | None = None,
        up: torch.Tensor | None = None,
        down: torch.Tensor | None = None,
        gate_bias: torch.Tensor | None = None,
        up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
    ) -> None:
        """Write any of one expert's HF-shaped weights (gate/up [I, H], down [H, I]) and, for a layout
        with biases, biases (gate/up [I], down [H]); the loader streams them one by one."""
        row = self.row(layer, expert)
        for part, src in (("gate", gate), ("up", up), ("down", down), ("gate_bias", gate_bias),
                          ("up_bias", up_bias), ("down_bias", down_bias)):
            if src is not None:
                self._write(layer, row, part, src)

    def put_fused(self, layer: int, *, gate_up: torch.Tensor | None = None, gate: torch.Tensor | None = None,
                  up: torch.Tensor | None = None, down: torch.Tensor | None = None,
                  gate_up_bias: torch.Tensor | None = None, gate_bias: torch.Tensor | None = None,
                  up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None) -> None:
        """Write all experts of a layer from 3-D tensors: transformers 5's fused gate_up [E, 2I, H] and
        down [E, H, I], or GGUF's gate and up [E, I, H] apart; biases, for a layout with them, from
        2-D ones (gate_up [E, 2I], gate/up [E, I], down [E, H])."""
        for part, src in (("gate_up", gate_up), ("gate", gate), ("up", up), ("down", down),
                          ("gate_up_bias", gate_up_bias), ("gate_bias", gate_bias), ("up_bias", up_bias),
                          ("down_bias", down_bias)):
            if src is None:
                continue
            if src.shape[0] != self.num_experts:
                raise ValueError(f"expert weight has {src.shape[0]} experts, expected {self.num_experts}")
            for expert, weights in enumerate(src):  # one expert at a time: encoding needs fp32 temporaries
                self._write(layer, self.row(layer, expert), part, weights)

    def _write(self, layer: int, row: torch.Tensor, part: str, w: torch.Tensor) -> None:
        layout = self.layouts[layer]
        encoded = not part.endswith(BIAS_SUFFIX)  # biases are stored as given, in the compute dtype
        if self.encode_on is not None and encoded and any(fmt.name != "none" for fmt in layout.formats):
            w = w.to(self.encode_on)  # write() copies the encoded bytes back into the row
        layout.write(row, part, w)

    def put_encoded(self, layer: int, expert: int | None, part: str, data: torch.Tensor,
                    scales: torch.Tensor | None) -> None:
        """Write one part of one expert (or, expert None, of all experts of a layer: a leading [E] dim)
        already encoded in the layer's format, as a quantized checkpoint publishes it."""
        layout = self.layouts[layer]
        if expert is not None:
            layout.write_encoded(self.row(layer, expert), part, data, scales)
            return
        if data.shape[0] != self.num_experts:
            raise ValueError(f"expert weight has {data.shape[0]} experts, expected {self.num_experts}")
        for e in range(self.num_experts):
            layout.write_encoded(self.row(layer, e), part, data[e], None if scales is None else scales[e])


def _pin(owner: ExpertStore, rows: torch.Tensor) -> None:
    """Page-lock rows' memory for as long as owner lives."""
    cudart = torch.cuda.cudart()
    ptr = rows.data_ptr()
    err = cudart.cudaHostRegister(ptr, rows.numel() * rows.element_size(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of the {rows.numel() * rows.element_size() / 2**30:.1f} GiB expert store failed ({err})")
    weakref.finalize(owner, cudart.cudaHostUnregister, ptr)
