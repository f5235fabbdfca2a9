"""Rotary position embedding: frequencies for each HF `rope_type`, and cos/sin for a span of positions.

The formulas follow transformers' `modeling_rope_utils` (default, linear, dynamic NTK, llama3,
yarn); tests compare our frequencies with theirs. Dynamic NTK is computed from the span's end
position alone (stateless), so it gives the same answer after a speculative rollback.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    max_position_embeddings: int = 2048
    factor: float = 1.0
    original_max_position_embeddings: int | None = None  # llama3 / yarn pre-training length
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None: derived from factor / mscale
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    partial_rotary_factor: float = 1.0  # the share of a head's dims rotated: its first ones (GLM-4.5: half)

    def __post_init__(self) -> None:
        if not 0 < self.partial_rotary_factor <= 1:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must be in (0, 1]")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> RopeConfig:
        """Read `rope_parameters` (transformers 5) or the older `rope_theta` + `rope_scaling`."""
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        if any(isinstance(v, dict) for v in params.values()):
            raise ValueError("per-layer-type rope_parameters are not supported")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        max_pos = int(hf.get("max_position_embeddings", 2048))
        original = params.get("original_max_position_embeddings", hf.get("original_max_position_embeddings"))
        factor = params.get("factor")
        if factor is None and rope_type == "yarn" and original:
            factor = max_pos / original
        return cls(
            rope_type=rope_type,
            theta=float(params.get("rope_theta", hf.get("rope_theta", 10000.0))),
            max_position_embeddings=max_pos,
            factor=float(factor if factor is not None else 1.0),
            original_max_position_embeddings=int(original) if original else None,
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=params.get("attention_factor"),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            partial_rotary_factor=float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))),
        )

    @property
    def pretrained_length(self) -> int:
        return self.original_max_position_embeddings or self.max_position_embeddings


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [dim/2]


def _linear(rope: RopeConfig, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0


def _dynamic(rope: RopeConfig, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
    # NTK-aware: raise the base once the sequence outgrows the trained length
    max_pos = rope.max_position_embeddings
    seq_len = max(seq_len, max_pos)
    base = rope.theta * ((rope.factor * seq_len / max_pos) - (rope.factor - 1)) ** (dim / (dim - 2))
    return _base_inv_freq(base, dim), 1.0


def _llama3(rope: RopeConfig, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
    inv_freq = _base_inv_freq(rope.theta, dim)
    old_len = rope.pretrained_length
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated, short ones kept, the band between blended smoothly
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)
    if rope.mscale and rope.mscale_all_dim:
        return yarn_mscale(rope.factor, rope.mscale) / yarn_mscale(rope.factor, rope.mscale_all_dim)
    return yarn_mscale(rope.factor)


def _yarn_correction_dim(rotations: float, dim: int, base: float, length: int) -> float:
    return (dim * math.log(length / (rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn(rope: RopeConfig, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
    length = rope.pretrained_length
    low = _yarn_correction_dim(rope.beta_fast, dim, rope.theta, length)
    high = _yarn_correction_dim(rope.beta_slow, dim, rope.theta, length)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [dim/2]
    extrapolation = _base_inv_freq(rope.theta, dim)
    interpolation = extrapolation / rope.factor
    keep = 1 - ramp  # 1 where frequencies are high enough to keep as trained
    return interpolation * (1 - keep) + extrapolation * keep, _yarn_attention_factor(rope)


def _default(rope: RopeConfig, dim: int, seq_len: int) -> tuple[torch.Tensor, float]:
    return _base_inv_freq(rope.theta, dim), 1.0


_FREQUENCIES = {"default": _default, "linear": _linear, "dynamic": _dynamic, "llama3": _llama3, "yarn": _yarn}


def rope_frequencies(rope: RopeConfig, dim: int, seq_len: int = 0) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32 on CPU, scale applied to cos and sin) for sequences up to seq_len."""
    return _FREQUENCIES[rope.rope_type](rope, dim, seq_len)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = head_dim
        inv_freq, self.scaling = rope_frequencies(rope, head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [D/2]

    def cos_sin(self, start: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for positions start..start+length-1, each [T, 1, D] (broadcast over heads)."""
        inv_freq = self.inv_freq
        if self.rope.rope_type == "dynamic":
            inv_freq = rope_frequencies(self.rope, self.head_dim, start + length)[0].to(inv_freq.device)
        positions = torch.arange(start, start + length, device=inv_freq.device)  # [T]
        return self.cos_sin_at(positions, dtype, inv_freq)

    def cos_sin_chunks(self, chunks: list[tuple[int, int]], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, D] for several sequences' chunks (start, length), concatenated in order."""
        parts = [self.cos_sin(start, length, dtype) for start, length in chunks]
        return torch.cat([c for c, _ in parts]), torch.cat([s for _, s in parts])

    def cos_sin_at(self, positions: torch.Tensor, dtype: torch.dtype,
                   inv_freq: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for a device tensor of positions [T] (no host values: CUDA-graph safe)."""
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.scaling).to(dtype)[:, None, :]
        sin = (emb.sin() * self.scaling).to(dtype)[:, None, :]
        return cos, sin


def pairs_to_halves_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A q or k projection (weight [heads * D, H] or bias [heads * D]) whose heads rotate adjacent
    pairs of dims (rows 2 i, 2 i + 1: llama.cpp's order, ERNIE's own) reordered so that each head's
    pair i is its rows i, D/2 + i, which apply_rotary's rotate-half turns alike. q.k is the same
    when q and k are reordered together."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, n, D] by cos/sin [T, 1, R] (the HF "rotate half" convention): its first R dims,
    the others passing as they are (a partial rotation, R < D)."""
    if cos.shape[-1] < x.shape[-1]:
        rotary = cos.shape[-1]
        return torch.cat([apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [T, n, D]
    return x * cos + rotated * sin
