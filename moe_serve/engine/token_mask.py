"""TokenMask: the tokens each row of a batch may take this step, as grammar bits, and the logits
that keeps (-inf at every other token).

moe_serve/engine/structured.py fills the bits on the host, llguidance's layout: bit j of 32-bit
word w allows token 32 w + j. On CUDA the sampler reads them where they were filled: the rows are
pinned host memory, which the device addresses directly, and one Triton kernel unpacks them and
applies them in a single pass over the logits. The copy to a device buffer and the three torch ops
that unpacked and applied it took 36-38 us of host time a step on the H100, this kernel 25-30 (alone,
at 1 and 32 rows of 8k tokens: README, Structured outputs), and a 25 MB model's ~1 ms step is all
host time. (The device's reads of the bits over PCIe, 1 KB a row, were not timed apart; the
engine's TPOT includes them.) On the CPU the same math runs as torch ops on the rows themselves.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: the CPU path only
    triton = None

_WORDS_PER_PROGRAM = 32  # 1024 tokens a program


@dataclass(frozen=True)
class TokenMask:
    """The grammar masks of a batch; a row without a grammar is all ones. One mask for the whole
    batch: a pass over every row costs less than gathering the constrained rows out and scattering
    them back."""

    bits: torch.Tensor  # [B, W] int32, 32 W >= V, on the host (pinned where the logits are on CUDA)
    # recorded once the device has read bits: their buffer is written again only after it (CUDA)
    read: torch.cuda.Event | None = None

    def restrict(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [B, V] with -inf at every forbidden token; a new tensor, so the logprobs still read
        the model's own logits."""
        if logits.is_cuda:
            return self._restrict_on_device(logits)
        # shifted so token j's bit lands on the sign bit, which signbit reads (int32 shifts wrap; `< 0`
        # would also make the 0 a tensor each step)
        allowed = torch.signbit(self.bits.unsqueeze(-1) << _sign_shifts()).flatten(1)  # [B, 32 W]
        if allowed.shape[1] != logits.shape[-1]:  # sliced only where V is no multiple of 32: one op fewer a step
            allowed = allowed[:, :logits.shape[-1]]  # [B, V]
        # where, not masked_fill: out of place, masked_fill is a clone and then the fill (two kernels)
        return torch.where(allowed, logits, _minus_inf(logits.dtype))  # [B, V]

    def _restrict_on_device(self, logits: torch.Tensor) -> torch.Tensor:
        rows, vocab_size = logits.shape
        assert logits.stride(1) == 1, "the kernel reads each row's logits in one run"
        words = self.bits.shape[1]
        restricted = torch.empty((rows, vocab_size), dtype=logits.dtype, device=logits.device)  # [B, V]
        grid = (rows, triton.cdiv(words, _WORDS_PER_PROGRAM))
        _restrict_kernel[grid](logits, self.bits, restricted, vocab_size, words, logits.stride(0),
                               WORDS=_WORDS_PER_PROGRAM)
        self.record_read()
        return restricted

    def record_read(self) -> None:
        """After the launch of a kernel that reads bits (this one, race.py's): their buffer is written
        again only once it ran."""
        if self.read is not None:
            self.read.record()


@cache
def _sign_shifts() -> torch.Tensor:
    """[32] int32 31, 30, ..., 0: the CPU path's shifts, made once rather than per step."""
    return torch.arange(31, -1, -1, dtype=torch.int32)


@cache
def _minus_inf(dtype: torch.dtype) -> torch.Tensor:
    """A 0-dim -inf in the logits' dtype: the CPU path's fill value (a Python float there becomes a
    new tensor each step)."""
    return torch.tensor(float("-inf"), dtype=dtype)


if triton is not None:
    @triton.jit
    def _restrict_kernel(logits_ptr, bits_ptr, out_ptr, vocab_size, words_per_row, row_stride,
                         WORDS: tl.constexpr):
        """out[b, v] = logits[b, v] where bit v of row b's bits is set, else -inf: WORDS words (32 WORDS
        tokens) of row program_id(0) per program. bits [B, words_per_row] int32, packed rows; out packed."""
        row = tl.program_id(0)
        word = tl.program_id(1) * WORDS + tl.arange(0, WORDS)  # [WORDS]
        bits = tl.load(bits_ptr + row * words_per_row + word, mask=word < words_per_row, other=0)  # [WORDS]
        bit = tl.arange(0, 32)  # [32]
        allowed = _bit_set(bits[:, None], bit[None, :])  # [WORDS, 32]
        token = word[:, None] * 32 + bit[None, :]  # [WORDS, 32]
        inside = token < vocab_size
        logits = tl.load(logits_ptr + row * row_stride + token, mask=inside)
        tl.store(out_ptr + row * vocab_size + token, tl.where(allowed, logits, float("-inf")), mask=inside)

    @triton.jit
    def _bit_set(word, bit):
        """Whether bit `bit` of int32 `word` is set: llguidance's layout, bit v % 32 of word v // 32 allows
        token v (an arithmetic shift, then the one bit)."""
        return ((word >> bit) & 1) != 0

    @triton.jit
    def allowed_logits(logits_row, bits_ptr, row, words_per_row, vocab_size, v, MASKED: tl.constexpr):
        """logits at tokens v [BLOCK] of one row (race.py), -inf at tokens past the vocabulary or, when
        MASKED, forbidden by the row's bits."""
        inside = v < vocab_size
        logits = tl.load(logits_row + v, mask=inside, other=float("-inf"))
        if MASKED:
            word = tl.load(bits_ptr + row * words_per_row + v // 32, mask=inside, other=0)
            logits = tl.where(_bit_set(word, v % 32), logits, float("-inf"))
        return logits
