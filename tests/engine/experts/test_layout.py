"""ExpertLayout's biases (gpt-oss): two sections after the weights' and scales', in the compute dtype,
written per part and read back as written; a layout without them is the row it always was."""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.experts.activation import ExpertActivation
from moe_serve.engine.experts.layout import ExpertLayout
from tests.engine.experts.slot_rows import quant_layout

H, I, E = 40, 24, 3


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_biases_follow_the_weights_and_read_back_as_written(quant):
    plain = quant_layout(H, I, torch.bfloat16, quant)
    layout = quant_layout(H, I, torch.bfloat16, quant, biases=True)
    assert plain.activation == ExpertActivation("silu") and not plain.biases
    assert not any(name.endswith(".bias") for name in plain.sections)
    # the weights and scales stay where they were; the biases follow, 16-byte aligned, in bf16
    weights_end = max(s.offset + s.nbytes for s in plain.sections.values())
    assert {name: s for name, s in layout.sections.items() if not name.endswith(".bias")} == plain.sections
    gate_up, down = layout.sections["gate_up.bias"], layout.sections["down.bias"]
    assert (gate_up.rows, gate_up.cols, down.rows, down.cols) == (1, 2 * I, 1, H)
    assert gate_up.dtype == down.dtype == torch.bfloat16
    assert weights_end <= gate_up.offset < weights_end + 16
    assert gate_up.offset % 16 == 0 == down.offset % 16
    assert down.offset >= gate_up.offset + gate_up.nbytes
    assert layout.nbytes == -(-(down.offset + down.nbytes) // 16) * 16

    gen = torch.Generator().manual_seed(0)
    rows, plain_rows = (torch.zeros(E, lay.numel, dtype=lay.row_dtype) for lay in (layout, plain))
    weights = {"gate_up": torch.randn(E, 2 * I, H, generator=gen), "down": torch.randn(E, H, I, generator=gen)}
    for part, w in weights.items():
        layout.write(rows, part, w)
        plain.write(plain_rows, part, w)
    gate_b, up_b, down_b = (torch.randn(E, n, generator=gen) for n in (I, I, H))
    for part, b in (("gate_bias", gate_b), ("up_bias", up_b), ("down_bias", down_b)):  # batched: all experts at once
        layout.write(rows, part, b)
    assert torch.equal(layout.bias(rows, "gate_up"), torch.cat([gate_b, up_b], dim=-1).bfloat16())  # [E, 2I]
    assert torch.equal(layout.bias(rows, "down"), down_b.bfloat16())  # [E, H]
    for matrix in ("gate_up", "down"):  # the weights decode as they do without biases
        assert torch.equal(layout.weights(rows, matrix), plain.weights(plain_rows, matrix))
        assert plain.bias(plain_rows, matrix) is None
    fused = torch.randn(2 * I, generator=gen)  # gate_up's in one part, one expert
    layout.write(rows[1], "gate_up_bias", fused)
    assert torch.equal(layout.bias(rows[1], "gate_up"), fused.bfloat16())
    # the kernels read the biases through one view of the slots, at element_offset of their section
    view = layout.bias_kernel_view(rows)
    assert torch.equal(view[2, layout.element_offset("down.bias"):][:H], down_b[2].bfloat16())
    assert plain.bias_kernel_view(plain_rows) is None


def test_bias_parts_are_checked():
    plain = ExpertLayout(H, I, torch.float32)
    with pytest.raises(ValueError, match="down_bias given for experts without biases"):
        plain.write(torch.zeros(plain.numel), "down_bias", torch.zeros(H))
    layout = ExpertLayout(H, I, torch.float32, biases=True)
    with pytest.raises(ValueError, match="expert bias has shape \\(48,\\), expected \\(24,\\)"):
        layout.write(torch.zeros(layout.numel), "up_bias", torch.zeros(2 * I))
