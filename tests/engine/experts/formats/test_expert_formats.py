"""Each expert format: encode -> decode stays within the format's own rounding bound of the
original weights, rows are as small as the format promises, and a layout places the parts of an
expert so that they encode independently (the loader streams them one tensor at a time).
"""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.experts.formats import FORMAT_NAMES, expert_format
from moe_serve.engine.experts.formats.base import divide
from moe_serve.engine.experts.formats.fp8 import E4M3_MAX
from moe_serve.engine.experts.formats.int4 import group_size
from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.store import ExpertStore
from tests.engine.experts.slot_rows import fitted_cases

QUANTIZED = [name for name in FORMAT_NAMES if name != "none"]
# [N, K]: odd K (int4's half byte), K under one int4 group, K over several with a partial last one
SHAPES = [(37, 45), (8, 300), (5, 1)]


def _weights(n: int, k: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) / k**0.5
    w[0] = 0.0  # an all-zero row must survive (no 0/0 scale)
    if n > 2:
        w[2, 0] = 40.0 / k**0.5  # an outlier: it sets its row's (or group's) scale
    return w.to(dtype)


def _round_trip(name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    fmt = expert_format(name, torch.float32)
    data, scales = fmt.encode(w)
    assert data.dtype == fmt.data_dtype and data.shape == (w.shape[0], fmt.data_cols(w.shape[1]))
    if scales is not None:
        assert scales.dtype == fmt.scale_dtype and scales.shape == (w.shape[0], fmt.scale_cols(w.shape[1]))
    return fmt.decode(data, scales, w.shape[1], torch.float32), data, scales


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_int8_error_is_at_most_half_a_step_of_its_row(n, k, source):
    w = _weights(n, k, source).float()
    got, _, _ = _round_trip("int8", w)
    step = w.abs().amax(dim=1, keepdim=True) / 127  # [N, 1]
    assert ((got - w).abs() <= step / 2 * (1 + 1e-4)).all()  # + fp32 rounding of w / s and q * s
    assert torch.equal(got[0], torch.zeros(k))


@pytest.mark.parametrize("n,k", SHAPES)
def test_int4_error_is_at_most_half_a_step_of_its_group(n, k):
    w = _weights(n, k)
    got, _, scales = _round_trip("int4", w)
    g = group_size(k)
    step = scales.float().repeat_interleave(g, dim=1)[:, :k]  # [N, K] each weight's group scale
    assert ((got - w).abs() <= step / 2 * (1 + 1e-3)).all()
    groups = torch.nn.functional.pad(w.abs(), (0, scales.shape[1] * g - k)).view(n, -1, g).amax(-1)  # [N, G]
    nonzero = groups > 0
    # scale = absmax / 7 (in fp16): the largest weight of a group lands on +-7
    torch.testing.assert_close(scales.float()[nonzero], (groups / 7)[nonzero], rtol=1e-3, atol=0)
    assert torch.equal(got[0], torch.zeros(k))


def test_int4_packs_two_weights_per_byte_low_nibble_first():
    w = torch.tensor([[-7.0, 7.0, 0.0]])  # scale 1: nibbles 1, 15, 8, then the padding nibble 8
    _, data, scales = _round_trip("int4", w)
    assert scales.item() == 1.0 and data.tolist() == [[1 | 15 << 4, 8 | 8 << 4]]


@pytest.mark.parametrize("n,k", SHAPES)
def test_fp8_error_is_at_most_half_an_e4m3_ulp(n, k):
    w = _weights(n, k)
    got, _, scales = _round_trip("fp8", w)
    scaled = w / scales  # [N, K] in e4m3's range, its absmax at 448
    # 3 mantissa bits: half an ulp is 2^-4 of the value for normals, 2^-10 absolute below 2^-6
    bound = torch.maximum(scaled.abs() * 2**-4, torch.full_like(scaled, 2**-10)) * scales
    assert ((got - w).abs() <= bound * (1 + 1e-4)).all()
    torch.testing.assert_close(scaled.abs().amax(dim=1)[1:], torch.full((n - 1,), E4M3_MAX))


@pytest.mark.parametrize("name,rel", [("int8", 0.01), ("int4", 0.12), ("fp8", 0.04)])
def test_relative_error_on_gaussian_weights(name, rel):
    """The whole-matrix error each format is chosen for, on weights without outliers."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(3)) / 512**0.5
    got, _, _ = _round_trip(name, w)
    assert (got - w).norm() / w.norm() < rel


def test_plain_format_is_a_view_of_the_old_packed_row():
    """--expert-quant none keeps rows byte for byte as before: [gate | up | down] in the model dtype."""
    h, i = 4096, 14336  # Mixtral
    layout = ExpertLayout(h, i, torch.bfloat16)
    assert layout.row_dtype == torch.bfloat16 and layout.numel == 3 * i * h and layout.nbytes == 6 * i * h
    assert layout.element_offset("gate_up") == 0 and layout.element_offset("down") == 2 * i * h
    small = ExpertLayout(8, 4, torch.float32)
    row = torch.arange(small.numel, dtype=torch.float32)
    assert small.gate_up(row).data_ptr() == row.data_ptr()  # a view, nothing decoded
    assert torch.equal(small.down(row), row[64:].view(8, 4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_bytes_per_expert_shrink_by_format(dtype):
    h, i = 4096, 14336  # Mixtral: int4 must copy at most 0.3x the bf16 bytes over PCIe
    base = ExpertLayout(h, i, dtype).nbytes
    bytes_of = {name: ExpertLayout(h, i, dtype, expert_format(name, dtype)).nbytes for name in QUANTIZED}
    weights = 3 * i * h
    assert bytes_of["int8"] == bytes_of["fp8"] == weights + 4 * (2 * i + h)  # + one fp32 scale per row
    assert bytes_of["int4"] == weights // 2 + 2 * (2 * i * (h // 128) + h * (i // 128))  # + fp16 group scales
    if dtype == torch.bfloat16:
        assert bytes_of["int4"] / base < 0.27 and bytes_of["int8"] / base < 0.51


@pytest.mark.parametrize("name", QUANTIZED)
def test_parts_encode_independently(name):
    """Streaming gate, up and down one by one gives the rows a fused put (and pack_into) gives."""
    [(h, i)], e = fitted_cases([(37, 19)], name), 3
    layout = ExpertLayout(h, i, torch.float32, expert_format(name, torch.float32))
    per_part, fused = ExpertStore(1, e, layout), ExpertStore(1, e, layout)
    for store in (per_part, fused):
        store.rows.zero_()  # the padding between sections is never written
    experts = [(_weights(i, h, seed=3 * j), _weights(i, h, seed=3 * j + 1), _weights(h, i, seed=3 * j + 2))
               for j in range(e)]
    for j, (gate, up, down) in enumerate(experts):
        per_part.put(0, j, down=down)
        per_part.put(0, j, gate=gate, up=up)
    fused.put_fused(0, gate_up=torch.stack([torch.cat([g, u]) for g, u, _ in experts]))
    fused.put_fused(0, down=torch.stack([d for _, _, d in experts]))
    assert torch.equal(per_part.rows, fused.rows) and per_part.rows.dtype == torch.uint8
    gate, up, down = experts[1]
    decoded = layout.gate_up(fused.row(0, 1))  # [2I, H]
    reference = expert_format(name, torch.float32)
    for got, w in ((decoded[:i], gate), (decoded[i:], up), (layout.down(fused.row(0, 1)), down)):
        torch.testing.assert_close(got, reference.decode(*reference.encode(w), w.shape[1], torch.float32))


def test_unknown_format_is_refused_by_name():
    with pytest.raises(ValueError, match="nf4.*none, int8, int4, fp8, fp8-block"):
        expert_format("nf4", torch.bfloat16)


@pytest.mark.parametrize("divisor", [127.0, 448.0, 15.0, 63.0, 31.0, 3.0, -127.0, 7.0])
def test_divide_is_the_correctly_rounded_quotient(divisor):
    # fp32 quotients of fp32 operands, computed in fp64 and rounded once, are the correctly rounded
    # ones (53 bits leave double rounding harmless); a multiply by the divisor's fp32 reciprocal, what
    # CUDA does for `tensor / number`, misses some of them, which made GPU encodings differ from CPU ones
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(0)).abs_() * 3
    exact = (x.double() / divisor).float()
    assert torch.equal(divide(x, divisor), exact)
    assert not torch.equal(x * torch.tensor(1 / divisor, dtype=torch.float32), exact)
