"""What an expert weight format is: how one weight matrix [N, K] (N outputs, K the reduction dim)
is encoded as bytes, decoded by torch, and decoded inside the Triton expert kernels.

A format knows nothing of experts: ExpertLayout (layout.py) places an expert's matrices and
their scales in one row of bytes; the store, the cache slots and the copies move rows whatever
the format; compute.py decodes with `decode`, the kernels with `triton_load`. A format is one
file in this package plus its line in the registry (__init__.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: only the torch path decodes
    triton = None


class ExpertFormat(ABC):
    name: ClassVar[str]  # the --expert-quant value
    data_dtype: torch.dtype  # element of the packed weights, as the kernels read them
    scale_dtype: torch.dtype | None = None  # element of the scales; None: the format has none
    # block formats encode matrices of whole blocks: N and K multiples of these
    row_multiple: ClassVar[int] = 1
    col_multiple: ClassVar[int] = 1

    @classmethod
    def for_model(cls, dtype: torch.dtype) -> ExpertFormat:
        """The format for a model computing in dtype (quantized formats store the same for any)."""
        return cls()

    def data_cols(self, k: int) -> int:
        """Elements of data_dtype per encoded row of K weights."""
        return k

    def scale_cols(self, k: int) -> int:
        """Scales per encoded row of K weights."""
        return 0

    def scale_rows(self, n: int) -> int:
        """Rows of scales for a matrix of N rows: N, unless rows share scales (blocks of rows)."""
        return n

    @abstractmethod
    def encode(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """w [..., N, K] (any float dtype) -> data [..., N, data_cols(K)], scales [..., N, scale_cols(K)] or None."""

    @abstractmethod
    def decode(self, data: torch.Tensor, scales: torch.Tensor | None, k: int, dtype: torch.dtype) -> torch.Tensor:
        """The reference dequantization: [..., N, K] in dtype (a view where nothing needs decoding)."""

    def check_shape(self, n: int, k: int) -> None:
        """Raise ValueError naming the format when it cannot encode a matrix [N, K]."""
        if n % self.row_multiple or k % self.col_multiple:
            raise ValueError(f"{self.name} experts need matrices of whole {self.row_multiple} x {self.col_multiple} "
                             f"blocks; one is {n} x {k}")

    @property
    @abstractmethod
    def triton_load(self) -> Any:
        """A @triton.jit function load(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, TRANSPOSE, EVICT) -> tile:
        rows [R] of the matrix at w_ptr (its scales at s_ptr), columns k0 + arange(BLOCK_K) (masked
        past K), decoded to fp32 or the stored float dtype; [R, BLOCK_K], or [BLOCK_K, R] if TRANSPOSE.
        EVICT is tl.load's eviction_policy. Its tile's columns are in the order `triton_cols` gives."""

    @property
    def triton_cols(self) -> Any:
        """A @triton.jit function cols(k0, BLOCK_K) -> [BLOCK_K]: the column of the matrix at each
        place of triton_load's tile, which holds the columns k0 .. k0 + BLOCK_K - 1 in this order.
        In order, unless a format's bytes hold the columns of a tile in another order (GGUF's k-quants):
        the kernels then load the vector's elements in that order rather than put the weights back."""
        return columns_in_order

    @property
    def triton_dot(self) -> Any | None:
        """None, or a @triton.jit function dot(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, v_ptr) -> [R]
        fp32: each of rows [R] times the vector v (K elements at v_ptr) over columns k0 + arange(BLOCK_K).
        The fused GEMV kernels use it instead of triton_load where decoding into a tile first costs
        more than the product itself (int4: a tile's two weights per byte are not interleaved back)."""
        return None

    def triton_codes_for(self, k: int, block_k: int) -> Any | None:
        """None, or a @triton.jit function codes(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K, DTYPE) ->
        (codes [BLOCK_K, R] in DTYPE, scale [R] fp32, zero [R] fp32) for tiles of block_k columns of a
        K = k matrix (DTYPE bf16 or fp16, the activations'): the tile's weights are exactly
        (codes - zero) * scale, each row's codes whole numbers DTYPE holds exactly, columns in
        triton_cols' order. The grouped kernel multiplies the codes on the tensor cores and applies
        zero and scale once per tile and row, where decoding each weight into a float costs more
        (int4-zp's zero points)."""
        return None

    def describe(self) -> str:
        return self.name


def divide(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """x / divisor, correctly rounded on every device. CUDA divides a tensor by a Python number as a
    multiply by the number's reciprocal, at times 1 ulp off the quotient; encoders divide through
    this so that experts encoded on the GPU at load get the bytes the CPU encoding writes."""
    return x / torch.full((), divisor, dtype=x.dtype, device=x.device)


def absmax_scales(w: torch.Tensor, qmax: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Symmetric scales over w's last dim, kept as a dim of 1: absmax / qmax in `dtype`. A range of 0
    (an all-zero row or group, or one below dtype's range) gets scale 1, so it encodes as zeros."""
    scales = divide(w.abs().amax(dim=-1, keepdim=True), qmax).to(dtype)
    return torch.where(scales > 0, scales, 1.0)


def pack_nibbles(values: torch.Tensor) -> torch.Tensor:
    """uint8 values in 0..15 [..., L] -> [..., ceil(L / 2)] bytes, value 2j in the low nibble of byte j
    (the order of int4, int4-zp and mxfp4, as GGML's and OCP MX's); an odd L ends in a 0 nibble."""
    values = F.pad(values, (0, values.shape[-1] % 2))
    return values[..., 0::2] | (values[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse: [..., B] bytes -> [..., 2B] values in 0..15 (uint8)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


if triton is not None:
    # Codes as subnormal floats. An int32 code 0 <= c < 2**23, taken as a float's bits, is the subnormal
    # c * 2**-149, exactly; times a vector's element scaled by VECTOR_SCALE (a power of two: exact) it is
    # c * v * 2**-48, exact before its one rounding, and normal for |c v| > 2**-78 (the scaled element
    # stays finite for |v| < 2**27); sums of such products go back by SUM_SCALE. A dot product of codes
    # then needs no int-to-float conversion, an instruction sm_90 issues at a fraction of an FMA's rate
    # (GPUs multiply subnormals at full rate; Triton's fp32 does not flush them). int4's dot, which
    # masks each nibble in place, took a Mixtral-size layer call from 0.110 to 0.079 ms on an H200 so
    # (bench/results/quant/quant_experts-h200-int4-subnormal.json).
    VECTOR_SCALE = tl.constexpr(2.0**101)
    SUM_SCALE = tl.constexpr(2.0**48)

    @triton.jit
    def code_dot(codes, v, axis: tl.constexpr):
        """sum(codes * v) over `axis` (fp32) for int32 codes 0 <= c < 2**23 and v (fp32, |v| < 2**27) of a
        shape that broadcasts with theirs, scaled where v is, before the broadcast: see VECTOR_SCALE."""
        return tl.sum(codes.to(tl.float32, bitcast=True) * (v * VECTOR_SCALE), axis=axis) * SUM_SCALE

    @triton.jit
    def code_fma(words, MASK: tl.constexpr, SHIFT: tl.constexpr, v, acc):
        """acc + c * v / SUM_SCALE for the code c at bit SHIFT of each word [R, W] (MASK its width), the
        product rounded once: masked in place, the code is the subnormal c * 2**SHIFT * 2**-149, so v
        ([W]) comes scaled by 2**-SHIFT more than VECTOR_SCALE (exact; once per tile for all R rows).
        SHIFT + the code's bits must stay within the mantissa's 23."""
        return tl.fma((words & (MASK << SHIFT)).to(tl.float32, bitcast=True), (v * (VECTOR_SCALE / (1 << SHIFT)))[None, :],
                      acc)

    @triton.jit
    def byte_code_products(words, MASK: tl.constexpr, SHIFT: tl.constexpr, v):
        """Per 32-bit word of words [R, ...], sum(c v) / SUM_SCALE over its 4 bytes' codes c at bit SHIFT of
        the byte (MASK their width; SHIFT + the width <= 8), byte b meeting v[..., b] (v [..., 4]: words'
        shape without R, then the bytes): each masked in place and taken into one fused multiply-add
        (code_fma), bytes 2 and 3 from the word shifted right by 16 (sign bits land above the masks)."""
        even, odd = tl.split(tl.reshape(v, v.shape[:-1] + [2, 2]))  # bytes 0 2 | 1 3
        v0, v2 = tl.split(even)
        v1, v3 = tl.split(odd)
        upper = words >> 16
        acc = (words & (MASK << SHIFT)).to(tl.float32, bitcast=True) * (v0 * (VECTOR_SCALE / (1 << SHIFT)))[None, :]
        acc = code_fma(words, MASK, SHIFT + 8, v1, acc)
        acc = code_fma(upper, MASK, SHIFT, v2, acc)
        return code_fma(upper, MASK, SHIFT + 8, v3, acc)

    @triton.jit
    def word_elements(v_ptr, word, word_ok):
        """The vector's elements 8w + j of each 32-bit word w of 8 codes (word [W], word_ok its mask), fp32:
        all of them [W, 8], then j = 0..7 apart ([W] each). Loaded as rows of 8 and split in registers:
        8 loads at a stride of 8 elements touched 4x the L1 sectors."""
        W: tl.constexpr = word.shape[0]
        v8 = tl.load(v_ptr + 8 * word[:, None] + tl.arange(0, 8)[None, :], mask=word_ok[:, None],
                     other=0.0).to(tl.float32)  # [W, 8]
        even, odd = tl.split(tl.reshape(v8, (W, 4, 2)))  # elements 0 2 4 6 | 1 3 5 7
        v04, v26 = tl.split(tl.reshape(even, (W, 2, 2)))
        v15, v37 = tl.split(tl.reshape(odd, (W, 2, 2)))
        v0, v4 = tl.split(v04)
        v1, v5 = tl.split(v15)
        v2, v6 = tl.split(v26)
        v3, v7 = tl.split(v37)
        return v8, v0, v1, v2, v3, v4, v5, v6, v7

    @triton.jit
    def columns_in_order(k0, BLOCK_K: tl.constexpr):
        return k0 + tl.arange(0, BLOCK_K)

    @triton.jit
    def in_order_dot(w, v_ptr, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
        """[R] fp32: a tile w [R, BLOCK_K] of columns k0 .. k0 + BLOCK_K - 1 in order (a tile narrower
        than a format's run, or rows a format's own dot does not read) times the vector's elements
        there: the tile dots' fallback. The vector is read only below K: past it lies other memory
        (the next token's, or none), where a NaN would make w's zeros NaN."""
        cols = k0 + tl.arange(0, BLOCK_K)
        v = tl.load(v_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
        return tl.sum(w * v[None, :], axis=1)
