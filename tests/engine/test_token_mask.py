"""TokenMask: exactly the tokens whose bits are set keep their logits, on the CPU's torch ops and in
the CUDA kernel, which reads the bits from pinned host rows in place (under Triton's interpreter on
a CPU, on a GPU when there is one)."""
from __future__ import annotations

import json
import random

import pytest
import torch

from moe_serve.engine.token_mask import TokenMask
from tests.triton_interpreter import needs_triton, run_interpreted

# (rows, vocab): a vocabulary cut inside a word, one of whole words, and one over several programs
CASES = [(3, 48), (2, 64), (5, 3000)]


def token_mask(allowed: dict[int, list[int]], rows: int, vocab: int, pinned: bool = False) -> TokenMask:
    """A grammar mask: row -> its allowed token ids, every other row all ones (moe_serve/engine/structured.py
    fills real ones)."""
    bits = torch.full((rows, (vocab + 31) // 32), 2**32 - 1, dtype=torch.int64)
    for row, ids in allowed.items():
        bits[row] = 0
        for t in ids:
            bits[row, t // 32] |= 1 << (t % 32)
    bits = ((bits + 2**31) % 2**32 - 2**31).int()  # as int32 bits
    return TokenMask(bits.pin_memory() if pinned else bits)


def random_allowed(rows: int, vocab: int, seed: int) -> dict[int, list[int]]:
    """Every row but the second constrained: one to nothing, the others to random tokens that include
    bit 31 of a word (the int32 sign bit) and the last token."""
    rng = random.Random(seed)
    allowed = {row: sorted({31, vocab - 1, *rng.sample(range(vocab), min(vocab, 40))}) for row in range(rows) if row != 1}
    allowed[0] = []
    return allowed


def assert_restricted(restricted: torch.Tensor, logits: torch.Tensor, allowed: dict[int, list[int]]) -> None:
    for row in range(logits.shape[0]):
        ids = allowed.get(row, list(range(logits.shape[1])))  # a row without a grammar keeps every token
        assert restricted[row].isfinite().nonzero().flatten().tolist() == ids
        assert torch.equal(restricted[row, ids], logits[row, ids])


def test_token_mask_forbids_exactly_the_unset_bits_and_leaves_free_rows_alone() -> None:
    for rows, vocab in CASES:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(4))  # [B, V]
        allowed = random_allowed(rows, vocab, seed=vocab)
        assert_restricted(token_mask(allowed, rows, vocab).restrict(logits), logits, allowed)


def check_kernel(cases: list[list[int]]) -> None:
    """The kernel (called as restrict calls it on CUDA) against the torch path, on CPU tensors."""
    for rows, vocab in cases:
        logits = torch.randn(rows, 2 * vocab, generator=torch.Generator().manual_seed(5))[:, :vocab]  # rows apart
        allowed = random_allowed(rows, vocab, seed=vocab + 1)
        mask = token_mask(allowed, rows, vocab)
        restricted = mask._restrict_on_device(logits)
        assert torch.equal(restricted, mask.restrict(logits))
        assert_restricted(restricted, logits, allowed)


@needs_triton
def test_interpreter_kernel_matches_the_torch_path() -> None:
    run_interpreted(__file__, f"check_kernel({json.dumps(CASES)})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_kernel_reads_pinned_bits_in_place(dtype: torch.dtype) -> None:
    for rows, vocab in CASES + [(32, 152_064)]:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(6)).to(dtype)
        allowed = random_allowed(rows, vocab, seed=vocab + 2)
        mask = token_mask(allowed, rows, vocab, pinned=True)
        mask = TokenMask(mask.bits, torch.cuda.Event())
        restricted = mask.restrict(logits.cuda())
        mask.read.synchronize()  # recorded after the kernel: the host rows may be written again
        assert_restricted(restricted.cpu(), logits, allowed)
