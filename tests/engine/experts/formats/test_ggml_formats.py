"""The GGML block formats (q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k, iq4_nl, iq4_xs): decoding is llama.cpp's dequantization bit for
bit (held to the gguf package's on arbitrary blocks), encoding round-trips within each type's
precision, and rows are exactly the GGUF bytes per weight."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from moe_serve.engine.experts.formats import expert_format
from moe_serve.engine.experts.formats.ggml_block import GgmlBlockFormat
from moe_serve.engine.experts.layout import ExpertLayout

GGML_FORMATS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")
# byte offsets of d (and dmin, m)
FP16_FIELDS = {"q8_0": (0,), "q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q5_1": (0, 2), "q2_k": (80, 82),
               "q3_k": (108,), "q4_k": (0, 2), "iq4_nl": (0,), "iq4_xs": (0,),
               "q5_k": (0, 2), "q6_k": (208,)}
# the formats whose encoder is llama.cpp's own (the k-quants' is a plain round-to-nearest)
LLAMA_CPP_ENCODERS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


def _format(name: str) -> GgmlBlockFormat:
    fmt = expert_format(name, torch.float32)
    assert isinstance(fmt, GgmlBlockFormat)
    return fmt


def _random_blocks(name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """Every byte random but the fp16 scales, which are finite normals: [rows, bytes of K]."""
    fmt, rng = _format(name), np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, k // fmt.block, fmt.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[name]:
        scales = rng.standard_normal(blocks.shape[:2]).astype(np.float16)
        blocks[..., offset : offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("name", GGML_FORMATS)
def test_sizes_are_the_ggml_types(name):
    fmt = _format(name)
    assert (fmt.block, fmt.block_bytes) == GGML_QUANT_SIZES[GGMLQuantizationType[fmt.ggml_type]]
    assert fmt.col_multiple == fmt.block and fmt.scale_dtype is None and fmt.data_dtype == torch.uint8


@pytest.mark.parametrize("name", GGML_FORMATS)
def test_decode_is_llama_cpp_dequantization_bit_for_bit(name):
    fmt, k = _format(name), 512
    data = _random_blocks(name, 6, k)
    expected = quants.dequantize(data, GGMLQuantizationType[fmt.ggml_type])  # [6, K]
    got = fmt.decode(torch.from_numpy(data).view(2, 3, -1), None, k, torch.float32)  # leading dims kept
    assert got.shape == (2, 3, k)
    np.testing.assert_array_equal(got.reshape(6, k).numpy(), expected)


@pytest.mark.parametrize("name,rel", [("q8_0", 0.01), ("q4_0", 0.12), ("q4_1", 0.09), ("q5_0", 0.06), ("q5_1", 0.045),
                                      ("q2_k", 0.36), ("q3_k", 0.18), ("q4_k", 0.09), ("q5_k", 0.045),
                                      ("q6_k", 0.025), ("iq4_nl", 0.09), ("iq4_xs", 0.09)])
def test_encode_round_trips_within_the_types_precision(name, rel):
    fmt = _format(name)
    w = torch.randn(64, 512, generator=torch.Generator().manual_seed(3)) / 512**0.5
    w[0] = 0.0  # an all-zero row encodes to zeros (no 0/0 scale)
    data, scales = fmt.encode(w)
    assert scales is None and data.dtype == torch.uint8 and data.shape == (64, fmt.data_cols(512))
    got = fmt.decode(data, None, 512, torch.float32)
    assert (got - w).norm() / w.norm() < rel
    assert torch.equal(got[0], torch.zeros(512))
    np.testing.assert_array_equal(got.numpy(), quants.dequantize(data.numpy(), GGMLQuantizationType[fmt.ggml_type]))


@pytest.mark.parametrize("name", LLAMA_CPP_ENCODERS)
def test_encodes_as_llama_cpp(name):
    w = torch.randn(4, 256, generator=torch.Generator().manual_seed(1))
    w[1, :32] = 0.25  # a block of one value: max == min, a zero step
    w[2, :32] = 0.0
    w[3, 5], w[3, 9] = 2.0, -2.0  # two of the largest magnitude: the first one's sign decides
    fmt = _format(name)
    data, _ = fmt.encode(w)
    np.testing.assert_array_equal(data.numpy(), quants.quantize(w.numpy(), GGMLQuantizationType[fmt.ggml_type]))


@pytest.mark.parametrize("name,bits", [("q8_0", 8.5), ("q4_0", 4.5), ("q4_1", 5), ("q5_0", 5.5), ("q5_1", 6),
                                       ("q2_k", 2.625), ("q3_k", 3.4375), ("q4_k", 4.5), ("q5_k", 5.5),
                                       ("q6_k", 6.5625), ("iq4_nl", 4.5), ("iq4_xs", 4.25)])
def test_bytes_per_expert(name, bits):
    h, i = 2048, 768  # Qwen3-30B-A3B
    layout = ExpertLayout(h, i, torch.bfloat16, expert_format(name, torch.bfloat16))
    assert set(layout.sections) == {"gate_up", "down"} and layout.row_dtype == torch.uint8
    assert layout.nbytes == 3 * h * i * bits / 8


@pytest.mark.parametrize("name", GGML_FORMATS)
def test_rows_of_partial_blocks_are_refused_by_name(name):
    fmt = _format(name)
    with pytest.raises(ValueError, match=f"{name} experts need matrices of whole 1 x {fmt.block} blocks"):
        fmt.encode(torch.zeros(4, fmt.block + 16))
