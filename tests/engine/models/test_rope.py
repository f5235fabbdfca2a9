"""Our rotary frequencies equal transformers' ROPE_INIT_FUNCTIONS for every supported rope_type."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from moe_serve.engine.models.rope import RopeConfig, RotaryEmbedding, apply_rotary, rope_frequencies

HEAD_DIM = 32
PARAMS = {
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "dynamic": dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0),
    "llama3": dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=256),
    "yarn": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256),
    "yarn-mscale": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=256,
                        mscale=1.0, mscale_all_dim=0.5, beta_fast=16, beta_slow=2),
}


def _hf(params: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, max_position_embeddings=1024,
                       rope_parameters=dict(params))


@pytest.mark.parametrize("name", PARAMS)
def test_frequencies_and_attention_scaling_match_transformers(name: str) -> None:
    hf = _hf(PARAMS[name])
    ours = RopeConfig.from_hf(hf.to_dict())
    for seq_len in (None, 4096):  # 4096 > max_position_embeddings: dynamic NTK rescales
        their_freq, their_scale = ROPE_INIT_FUNCTIONS[ours.rope_type](hf, "cpu", seq_len=seq_len)
        our_freq, our_scale = rope_frequencies(ours, HEAD_DIM, seq_len or 0)
        torch.testing.assert_close(our_freq, their_freq, atol=0, rtol=1e-6)
        assert our_scale == pytest.approx(their_scale)


def test_legacy_rope_theta_and_rope_scaling_are_read() -> None:
    rope = RopeConfig.from_hf({"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
                               "max_position_embeddings": 4096})
    assert (rope.rope_type, rope.theta, rope.factor, rope.max_position_embeddings) == ("linear", 5e5, 2.0, 4096)
    assert RopeConfig.from_hf({}).rope_type == "default"


@pytest.mark.parametrize("params", [{"rope_type": "longrope"}, {"rope_type": "default", "partial_rotary_factor": 1.5}])
def test_unsupported_rope_is_refused(params: dict) -> None:
    with pytest.raises(ValueError):
        RopeConfig.from_hf({"rope_parameters": params})


def test_rotation_preserves_norm_and_relative_position() -> None:
    rotary = RotaryEmbedding(RopeConfig(), HEAD_DIM)
    q, k = torch.randn(1, 1, HEAD_DIM), torch.randn(1, 1, HEAD_DIM)

    def score(q_pos: int, k_pos: int) -> torch.Tensor:
        qc, qs = rotary.cos_sin(q_pos, 1, torch.float32)
        kc, ks = rotary.cos_sin(k_pos, 1, torch.float32)
        return (apply_rotary(q, qc, qs) * apply_rotary(k, kc, ks)).sum()

    cos, sin = rotary.cos_sin(7, 1, torch.float32)
    torch.testing.assert_close(apply_rotary(q, cos, sin).norm(), q.norm())
    torch.testing.assert_close(score(10, 3), score(20, 13), atol=1e-4, rtol=0)


def test_a_partial_rotation_turns_the_first_dims_and_passes_the_rest() -> None:
    """GLM-4.5 rotates the first half of each head's dims (partial_rotary_factor 0.5)."""
    rotary = RotaryEmbedding(RopeConfig(partial_rotary_factor=0.5), HEAD_DIM // 2)
    x = torch.randn(3, 2, HEAD_DIM)  # [T, n, D]
    cos, sin = rotary.cos_sin(5, 3, torch.float32)  # [T, 1, D / 2]
    got = apply_rotary(x, cos, sin)
    torch.testing.assert_close(got[..., : HEAD_DIM // 2], apply_rotary(x[..., : HEAD_DIM // 2], cos, sin))
    assert torch.equal(got[..., HEAD_DIM // 2:], x[..., HEAD_DIM // 2:])
