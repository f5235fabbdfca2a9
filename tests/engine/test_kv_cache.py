"""KV cache bookkeeping, and speculative rollback: truncate then re-decode equals a fresh prefill."""
from __future__ import annotations

import pytest
import torch

from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.loader import LoadedModel, load_model
from tests.tiny_checkpoints import AllResidentRunner, build_tiny_checkpoint


@pytest.fixture(scope="module", params=["mixtral", "mistral"])  # mistral: sliding window 6 < sequence length
def loaded(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    path = build_tiny_checkpoint(request.param, tmp_path_factory.mktemp("ckpt") / request.param)
    return load_model(path, runner_factory=AllResidentRunner.factory, progress=False)


def _cache(loaded: LoadedModel) -> KVCache:
    return KVCache.for_model(loaded.config, 32, device="cpu", dtype=torch.float32)


def test_truncate_then_redecode_equals_fresh_prefill(loaded: LoadedModel) -> None:
    model = loaded.model
    tokens = torch.randint(3, 128, (16,), generator=torch.Generator().manual_seed(0))  # [16]
    fresh = model(tokens, 0, _cache(loaded))  # [16, V]

    kv = _cache(loaded)
    model(tokens[:10], 0, kv)
    model(torch.tensor([5, 6, 7, 8]), 10, kv)  # a rejected draft
    kv.truncate(10)
    one_by_one = torch.cat([model(tokens[i : i + 1], i, kv) for i in range(10, 13)])  # [3, V]
    kv.truncate(12)
    span = model(tokens[12:], 12, kv)  # a verify span: T > 1 starting mid-sequence

    torch.testing.assert_close(one_by_one, fresh[10:13], atol=1e-5, rtol=0)
    torch.testing.assert_close(span, fresh[12:], atol=1e-5, rtol=0)
    assert kv.length == 16


def test_last_only_returns_the_last_row(loaded: LoadedModel) -> None:
    tokens = torch.arange(3, 11)
    full = loaded.model(tokens, 0, _cache(loaded))
    last = loaded.model(tokens, 0, _cache(loaded), last_only=True)
    torch.testing.assert_close(last, full[-1:], atol=1e-5, rtol=0)


def test_forward_must_continue_where_the_cache_ends(loaded: LoadedModel) -> None:
    kv = _cache(loaded)
    loaded.model(torch.arange(3, 7), 0, kv)
    with pytest.raises(ValueError, match="truncate"):
        loaded.model(torch.arange(3, 5), 2, kv)


def test_bookkeeping() -> None:
    kv = KVCache(num_layers=2, max_len=8, num_kv_heads=2, head_dim=4, device="cpu", dtype=torch.float32)
    assert kv.nbytes == 2 * 2 * 8 * 2 * 4 * 4
    k = torch.randn(5, 2, 4)
    keys, values = kv.write(1, 0, k, -k)
    torch.testing.assert_close(keys, k)
    torch.testing.assert_close(values, -k)
    kv.length = 5
    with pytest.raises(ValueError, match="truncate"):
        kv.truncate(6)
    kv.truncate(2)
    assert kv.length == 2
    with pytest.raises(ValueError, match="overflow"):
        kv.write(0, 6, k, k)
    kv.reset()
    assert kv.length == 0
