"""ExpertStore: per-part and fused puts both produce ExpertLayout's packed rows; layers may differ in layout."""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.experts.formats import expert_format
from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.store import ExpertStore

H, I, E = 8, 4, 3


def _weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(I, H, generator=g), torch.randn(I, H, generator=g), torch.randn(H, I, generator=g)


def test_put_streams_parts_into_the_packed_row() -> None:
    layout = ExpertLayout(H, I, torch.float32)
    store = ExpertStore(2, E, layout)
    gate, up, down = _weights(0)
    store.put(1, 2, gate=gate)
    store.put(1, 2, down=down, up=up)
    expected = torch.empty(layout.numel)
    layout.pack_into(expected, gate, up, down)
    torch.testing.assert_close(store.row(1, 2), expected, atol=0, rtol=0)
    assert store.nbytes == 2 * E * layout.nbytes and not store.is_pinned


def test_fused_put_equals_per_expert_puts() -> None:
    layout = ExpertLayout(H, I, torch.bfloat16)
    per_expert, fused = ExpertStore(1, E, layout), ExpertStore(1, E, layout)
    experts = [_weights(e) for e in range(E)]
    for e, (gate, up, down) in enumerate(experts):
        per_expert.put(0, e, gate=gate, up=up, down=down)
    fused.put_fused(0, gate_up=torch.stack([torch.cat([g, u]) for g, u, _ in experts]))  # [E, 2I, H]
    fused.put_fused(0, down=torch.stack([d for _, _, d in experts]))  # [E, H, I]
    torch.testing.assert_close(fused.rows, per_expert.rows, atol=0, rtol=0)
    assert fused.rows.dtype == torch.bfloat16


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_biases_put_per_expert_or_fused_land_in_the_rows(quant) -> None:
    layout = ExpertLayout(H, I, torch.bfloat16, expert_format(quant, torch.bfloat16), biases=True)
    per_expert, fused = ExpertStore(1, E, layout), ExpertStore(1, E, layout)
    g = torch.Generator().manual_seed(2)
    gate_bias, up_bias, down_bias = (torch.randn(E, n, generator=g) for n in (I, I, H))
    for e, (gate, up, down) in enumerate(_weights(e) for e in range(E)):
        per_expert.put(0, e, gate=gate, up=up, down=down, gate_bias=gate_bias[e], up_bias=up_bias[e],
                       down_bias=down_bias[e])
        fused.put(0, e, gate=gate, up=up, down=down)
    fused.put_fused(0, gate_up_bias=torch.cat([gate_bias, up_bias], dim=-1), down_bias=down_bias)  # [E, 2I], [E, H]
    assert torch.equal(fused.rows, per_expert.rows)
    rows = fused.rows[0]
    assert torch.equal(layout.bias(rows, "gate_up"), torch.cat([gate_bias, up_bias], dim=-1).bfloat16())
    assert torch.equal(layout.bias(rows, "down"), down_bias.bfloat16())


def test_misshaped_weight_is_refused() -> None:
    store = ExpertStore(1, E, ExpertLayout(H, I, torch.float32))
    with pytest.raises(ValueError, match="shape"):
        store.put(0, 0, gate=torch.zeros(H, I))
    with pytest.raises(ValueError, match="shape"):
        store.put_fused(0, down=torch.zeros(E, I, H))


def test_layers_of_different_layouts_share_one_row_length() -> None:
    """Layer 1's down projection in another format: the store's rows are as long as the largest
    layer's, row() is each layer's own bytes, writes take the layer's layout, and `layout` (the one
    every layer shares) names the difference."""
    q8_0, int8 = (expert_format(name, torch.float32) for name in ("q8_0", "int8"))
    layouts = [ExpertLayout(32, 32, torch.float32, q8_0), ExpertLayout(32, 32, torch.float32, q8_0, int8)]
    store = ExpertStore(2, E, layouts)
    assert store.row_numel == layouts[1].numel > layouts[0].numel and store.row_dtype == torch.uint8
    assert [store.row(layer, 0).numel() for layer in (0, 1)] == [layouts[0].numel, layouts[1].numel]
    down = torch.randn(32, 32)
    for layer in (0, 1):
        store.put(layer, 1, down=down)
        fmt = layouts[layer].format_of("down")
        torch.testing.assert_close(layouts[layer].down(store.row(layer, 1)),
                                   fmt.decode(*fmt.encode(down), 32, torch.float32), rtol=0, atol=0)
    assert store.format_name == "q8_0+int8"
    with pytest.raises(ValueError, match="different layouts: q8_0 .*layers 0.*q8_0 with down int8 \\(layers 1\\)"):
        store.layout
    with pytest.raises(ValueError, match="differ in element type"):
        ExpertStore(2, E, [layouts[0], ExpertLayout(32, 32, torch.float32)])


def test_only_a_cuda_store_encodes_on_its_device() -> None:
    assert ExpertStore.for_device(1, E, ExpertLayout(H, I, torch.float32), "cpu").encode_on is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("quant", ["int8", "int4", "fp8", "mxfp4", "q8_0", "q4_k", "q6_k", "iq4_xs"])
def test_cuda_encoding_at_load_writes_the_bytes_the_cpu_encoding_does(quant) -> None:
    h, i = 256, 512  # whole blocks of every format
    layout = ExpertLayout(h, i, torch.bfloat16, expert_format(quant, torch.bfloat16))
    on_gpu, on_cpu = ExpertStore.for_device(1, 2, layout, "cuda"), ExpertStore(1, 2, layout)
    assert on_gpu.encode_on == torch.device("cuda")
    g = torch.Generator().manual_seed(1)
    gate_up = (torch.randn(2, 2 * i, h, generator=g) / h**0.5).bfloat16()
    down = (torch.randn(2, h, i, generator=g) / i**0.5).bfloat16()
    for store in (on_gpu, on_cpu):
        store.put_fused(0, gate_up=gate_up, down=down)
        store.put(0, 1, down=down[0])
    assert torch.equal(on_gpu.rows, on_cpu.rows)
