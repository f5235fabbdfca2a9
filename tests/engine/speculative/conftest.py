"""Tiny checkpoints built once per session for the speculative-decoding tests."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from spec_harness import load_cached, load_dense

from moe_serve.engine.models.blocks import CausalLM
from tests.tiny_checkpoints import MOE_FAMILIES, build_tiny_checkpoint


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """checkpoint(family, seed=0) -> path of a tiny random checkpoint, built on first use."""
    built: dict[tuple[str, int], Path] = {}

    def get(family: str, seed: int = 0) -> Path:
        if (family, seed) not in built:
            built[family, seed] = build_tiny_checkpoint(family, tmp_path_factory.mktemp(f"{family}-{seed}"), seed=seed)
        return built[family, seed]

    return get


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """These models are tiny: a second intra-op thread only adds spin-waits (50x slower on a busy box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Every MoE family but two whose speculation adds nothing new to it: DeepSeek-V2 is V3's latent
# attention (cache, rollback) with softmax routing; dots.llm1 is Qwen3's attention with V3's routing
# (GLM-4.5 and DeepSeek-V3 run both). Their logits, batches and CUDA speculation are tested elsewhere.
SPEC_FAMILIES = tuple(f for f in MOE_FAMILIES if f not in ("deepseek_v2", "dots1"))


@pytest.fixture(scope="module", params=SPEC_FAMILIES)
def target(request: pytest.FixtureRequest, checkpoint: Callable[..., Path]) -> CausalLM:
    """Each MoE family on the cached runner with a budget of top_k + 1 experts."""
    return load_cached(checkpoint(request.param))


@pytest.fixture(scope="module")
def draft(checkpoint: Callable[..., Path]) -> CausalLM:
    """A random dense model sharing the targets' vocabulary and hidden size."""
    return load_dense(checkpoint("llama", seed=3))
