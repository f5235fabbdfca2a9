"""race.py's one-kernel draw gives the sampler's torch path's tokens: greedy rows' argmax (ties to the
lowest id) and sampled rows' exponential race from the same noise, alone or mixed in one batch,
under grammar masks or none
(Triton's interpreter on a CPU; the kernel on pinned mask rows on a GPU when there is one)."""
from __future__ import annotations

import json

import pytest
import torch

from moe_serve.engine.messages import SamplingParams
from moe_serve.engine.race import race_tokens
from moe_serve.engine.sampler import SamplingBatch, SamplingRow, _race, sample
from moe_serve.engine.token_mask import TokenMask
from tests.engine.test_token_mask import random_allowed, token_mask
from tests.triton_interpreter import needs_triton, run_interpreted

# (rows, vocab): one block with a cut word, several blocks (the best in a later one), a row per temperature
CASES = [(3, 48), (4, 2500), (5, 1100)]
TEMPERATURES = [1.0, 0.7, 2.0, 1e-3, 0.25]


def sampled_batch(rows: int, device: str, greedy: tuple[int, ...] = ()) -> SamplingBatch:
    """Rows sampled but for `greedy`, no top-k/top-p/min-p: the batches race.py draws for."""
    temperature = [0.0 if r in greedy else TEMPERATURES[r % len(TEMPERATURES)] for r in range(rows)]
    return SamplingBatch.build([SamplingRow(SamplingParams(max_tokens=8, temperature=temperature[r]),
                                            seed=1000 + r, output_ids=list(range(r))) for r in range(rows)], device)


def check_race(cases: list[list[int]], device: str = "cpu") -> None:
    """race_tokens on `device` against sample()'s torch path on the CPU."""
    for rows, vocab in cases:
        logits = 3 * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab))  # [B, V]
        allowed = random_allowed(rows, vocab, seed=vocab)
        allowed[0] = [5, 17, vocab - 1]  # random_allowed leaves row 0 nothing: a sampled row must have a token
        mask = token_mask(allowed, rows, vocab, pinned=device == "cuda")
        on_device = TokenMask(mask.bits, torch.cuda.Event() if device == "cuda" else None)
        batch, device_batch = sampled_batch(rows, "cpu"), sampled_batch(rows, device)
        x = logits.to(device)
        for expected, got in [
            (sample(logits, batch, lambda: mask).tokens,
             race_tokens(x, on_device, device_batch.temperature, device_batch.noise_key)),
            (sample(logits, batch).tokens, race_tokens(x, None, device_batch.temperature, device_batch.noise_key)),
            (mask.restrict(logits).argmax(-1), race_tokens(x, on_device)),
            (logits.argmax(-1), race_tokens(x, None)),
        ]:
            assert got.cpu().tolist() == expected.tolist()
        # greedy and sampled rows in one batch: the sampler's two launches, the second over the sampled rows
        mixed, device_mixed = sampled_batch(rows, "cpu", greedy=(0, 2)), sampled_batch(rows, device, greedy=(0, 2))
        for expected, got in [(sample(logits, mixed, lambda: mask).tokens, _race(x, device_mixed, on_device)),
                              (sample(logits, mixed).tokens, _race(x, device_mixed, None))]:
            assert got.cpu().tolist() == expected.tolist()
        # greedy ties go to the lowest id, across blocks too; a row with no allowed token gives 0 as argmax does
        tied = torch.zeros(rows, vocab)
        tied[:, [vocab // 3, vocab - 1]] = 1.0
        nothing = token_mask({r: [] for r in range(rows)}, rows, vocab, pinned=device == "cuda")
        assert race_tokens(tied.to(device), None).cpu().tolist() == [vocab // 3] * rows
        assert race_tokens(tied.to(device), TokenMask(nothing.bits)).cpu().tolist() == [0] * rows


@needs_triton
def test_interpreter_kernel_draws_the_torch_paths_tokens() -> None:
    run_interpreted(__file__, f"check_race({json.dumps(CASES)})")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kernel_draws_the_torch_paths_tokens() -> None:
    check_race(CASES + [[32, 152_064]], "cuda")
