"""GGUF's MXFP4 (--expert-quant mxfp4-ggml; llama.cpp's gpt-oss files, whose experts are published in
it): OCP Microscaling FP4, the weights mxfp4.py holds, in GGML's block layout. 17 bytes per 32
weights (4.25 bits): one E8M0 byte e, then 16 bytes qs, byte j holding weight j's E2M1 code in its
low nibble and weight j + 16's in its high one (IQ4_NL's order; mxfp4.py's safetensors layout puts
weights 2j and 2j + 1 in byte j and the scales apart). w = level[q] * 2^(e - 128), the levels
(llama.cpp's kvalues_mxfp4) being E2M1's values doubled: 0 1 2 3 4 6 8 12, then their negatives.
llama.cpp's converter re-lays gpt-oss's released blocks so without changing a code or a scale byte.

Decoding is llama.cpp's, bit for bit (the tests hold it to the gguf package's), for every scale
byte: 2^(e - 128) is built from its bits, a subnormal fp32 for e < 2, exactly as ggml builds it
(mxfp4.py reads 0 as zero and 255 as inf, bytes neither encoding writes). Encoding, for
--expert-quant and the tests, is mxfp4.py's (the least power-of-two scale that fits a block into
±6, nearest codes, ties to even), laid out here; llama.cpp's quantizer takes floor(log2 absmax) - 2,
which can saturate a block's largest weights.

The kernels' loads and tile dots are nibble_levels.py's, shared with IQ4_NL and IQ4_XS.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from moe_serve.engine.experts.formats.ggml_block import GgmlBlockFormat, split_nibbles, unsplit_nibbles
from moe_serve.engine.experts.formats.mxfp4 import E2M1_MAGNITUDES, e2m1_blocks
from moe_serve.engine.experts.formats.nibble_levels import levels_of

try:
    import triton
    import triton.language as tl

    from moe_serve.engine.experts.formats.nibble_levels import (
        dot_level_runs,
        level_of,
        level_run_cols,
        load_level_runs,
        packed_levels,
    )
except ImportError:  # no triton: only the torch path decodes
    triton = None

LEVELS = tuple(int(sign * 2 * magnitude) for sign in (1, -1) for magnitude in E2M1_MAGNITUDES)  # by code


def _halved_e8m0(e: torch.Tensor) -> torch.Tensor:
    """Scale bytes e [...] -> 2^(e - 128) in fp32, as ggml_e8m0_to_fp32_half builds it: e - 1 in the
    exponent bits, or for e < 2 the subnormal with bit 21 + e set."""
    e = e.to(torch.int32)
    return torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).view(torch.float32)


@dataclass(frozen=True)
class GgmlMxfp4(GgmlBlockFormat):
    name: ClassVar[str] = "mxfp4-ggml"
    ggml_type: ClassVar[str] = "MXFP4"
    block: ClassVar[int] = 32
    block_bytes: ClassVar[int] = 17
    col_multiple: ClassVar[int] = 32

    def encode_blocks(self, w: torch.Tensor) -> torch.Tensor:
        codes, scales = e2m1_blocks(w)  # [..., 32], [..., 1]
        return torch.cat((scales, split_nibbles(codes)), dim=-1)

    def decode_blocks(self, blocks: torch.Tensor) -> torch.Tensor:
        return _halved_e8m0(blocks[..., 0])[..., None] * levels_of(unsplit_nibbles(blocks[..., 1:]), LEVELS)

    @property
    def triton_load(self) -> Any:
        return _load

    @property
    def triton_dot(self) -> Any:
        return _dot

    @property
    def triton_cols(self) -> Any:
        return level_run_cols


if triton is not None:
    _W0, _W4, _W8, _W12 = (tl.constexpr(word) for word in packed_levels(LEVELS))

    @triton.jit
    def _level(q):
        return level_of(q, _W0, _W4, _W8, _W12)

    @triton.jit
    def _step(block, sub, mask):
        """2^(e - 128) from the block's first byte, as _halved_e8m0 builds it (0 under the mask: 2^-128,
        times the masked codes' level 0)."""
        e = tl.load(block, mask=mask, other=0).to(tl.int32)
        return tl.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(tl.float32, bitcast=True)

    # blocks of 32 weights in 17 bytes, the codes after the scale byte

    @triton.jit
    def _load(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, TRANSPOSE: tl.constexpr,
              EVICT: tl.constexpr):
        return load_level_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT, 32, 17, 1, _step, _level)

    @triton.jit
    def _dot(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr, v_ptr):
        return dot_level_runs(w_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr, 32, 17, 1, _step, _level)
