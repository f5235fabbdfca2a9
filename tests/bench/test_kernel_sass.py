"""bench/kernel_sass.py builds the expert kernels' gate/up for sm_90 on a CPU and counts their K loop:
the tile dots that read codes as subnormal floats keep int-to-float conversions out of the one-token
loop, and the grouped kernel's bf16 loop is its loads and tensor-core multiplies."""
from __future__ import annotations

import pytest

from tests.triton_interpreter import needs_triton


@needs_triton
@pytest.mark.parametrize("quant", ["int4", "int8", "q4_k"])
def test_the_code_dots_loop_converts_no_int_to_float_per_weight(quant):
    from bench.kernel_sass import count

    row = count(quant)
    assert row["tile_dot"] and row["loop_instructions"] > 0
    # int8 and q4_k issued a conversion a weight before, int4 5.5 instructions a weight
    # (bench/results/quant/kernel_sass-sm90-before-code-dot.json, README: Quantized experts: speed)
    assert row["conversions_per_weight"] < 0.1, row
    assert row["instructions_per_weight"] < {"int4": 4.0, "int8": 5.0, "q4_k": 6.0}[quant], row


@needs_triton
def test_the_grouped_kernel_multiplies_on_tensor_cores():
    from bench.kernel_sass import count

    row = count("none", "grouped")
    # bf16 tiles go to mma as loaded: the loop is the loads and the HMMAs, ~1.25 instructions a weight
    assert row["kernel"] == "grouped" and "HMMA" in row["opcodes"] and row["instructions_per_weight"] < 2.0, row


@needs_triton
def test_the_int4_down_loop_copies_its_activations_asynchronously():
    from bench.kernel_sass import count

    row = count("int4", "grouped-int4-down")
    # with a run-time chunk of I, act's tiles went through registers and stores, 4.45 instructions a weight
    # (bench/results/quant/kernel_sass-grouped-int4-down-sm90-before-constant-chunk.json)
    assert "LDGSTS" in row["opcodes"] and row["instructions_per_weight"] < 4.0, row


@needs_triton
def test_the_loop_is_the_span_of_the_backward_branch():
    from bench.kernel_sass import loop_body

    sass = "\n".join([
        "        /*0000*/                   MOV R1, c[0x0][0x28] ;",
        ".L_x_0:",
        "        /*0010*/                   LOP3.LUT R2, R3, 0xf, RZ, 0xc0, !PT ;",
        "        /*0020*/                   FFMA R4, R2, R5, R4 ;",
        "        /*0030*/               @P0 BRA `(.L_x_0) ;",
        "        /*0040*/                   EXIT ;",
        ".L_x_1:",
        "        /*0050*/                   BRA `(.L_x_1);",
    ])
    assert loop_body(sass) == ["LOP3", "FFMA", "BRA"]
