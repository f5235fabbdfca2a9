"""Every family, both expert layouts on disk: our fp32 logits equal transformers' on prefill and
over 32 greedy decode steps through the KV cache, and the greedy tokens are identical."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.loader import load_model
from tests.tiny_checkpoints import DENSE_FAMILIES, MOE_FAMILIES, AllResidentRunner, build_tiny_checkpoint, tiny_hf_model

DECODE_STEPS = 32
CASES = [(f, False) for f in MOE_FAMILIES + DENSE_FAMILIES] + [(f, True) for f in MOE_FAMILIES]


def _greedy_with_cache(path: Path, prompt: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """Our logits for every position ([P + steps, V]) and the greedy tokens chosen from them."""
    model, _, config = load_model(path, runner_factory=AllResidentRunner.factory, progress=False)
    kv = KVCache.for_model(config, 64, device="cpu", dtype=torch.float32)
    rows = [model(prompt, 0, kv)]  # [P, V]
    generated: list[int] = []
    for _ in range(DECODE_STEPS):
        generated.append(int(rows[-1][-1].argmax()))
        rows.append(model(torch.tensor(generated[-1:]), kv.length, kv))  # [1, V]
    return torch.cat(rows), generated


@pytest.mark.parametrize(("family", "fused"), CASES, ids=[f"{f}-{'fused' if u else 'per_expert'}" for f, u in CASES])
def test_logits_and_greedy_tokens_match_transformers(family: str, fused: bool, tmp_path: Path) -> None:
    prompt = torch.randint(3, 128, (9,), generator=torch.Generator().manual_seed(1))  # [P]
    path = build_tiny_checkpoint(family, tmp_path / family, fused_experts=fused)
    ours, generated = _greedy_with_cache(path, prompt)

    full = torch.cat([prompt, torch.tensor(generated)])  # [P + steps]
    with torch.no_grad():
        theirs = tiny_hf_model(family)(full[None]).logits[0]  # [P + steps, V]

    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    their_greedy = theirs[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
    assert generated == their_greedy
    assert len(set(generated)) > 4, "degenerate tiny model: greedy output barely varies"
