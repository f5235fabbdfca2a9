"""llama.cpp's K-quant mixes: which layers' down projections get the larger type."""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.experts.formats.mixes import mix_formats, more_bits
from moe_serve.engine.loader import read_config
from tests.tiny_checkpoints import build_tiny_checkpoint


def test_more_bits_for_the_first_and_last_eighth_and_every_third_layer_between():
    # a 32-layer model (Mixtral 8x7B): layers 0-3, 28-31, and 6, 9, ..., 27
    assert [i for i in range(32) if more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(6) if more_bits(i, 6)] == [2, 5]  # under 8 layers no eighth: every third and the last


def test_gate_and_up_keep_the_base_type():
    assert mix_formats("q4_k_m", 0, 32) == ("q4_k", "q6_k")
    assert mix_formats("q4_k_m", 4, 32) == ("q4_k", "q4_k")
    assert mix_formats("q5_k_m", 5, 32) == ("q5_k", "q5_k")


def test_a_quantized_checkpoint_refuses_a_mix(tmp_path):
    from dataclasses import replace

    config = replace(read_config(build_tiny_checkpoint("mixtral", tmp_path / "m", hidden_size=256,
                                                       intermediate_size=256)), published_expert_format="q8_0")
    with pytest.raises(ValueError, match="experts are q8_0: --expert-quant q4_k_m would quantize them again"):
        config.expert_layouts(torch.float32, "q4_k_m")
