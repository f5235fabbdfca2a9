"""The GGUF tests build tokenizers into a cache of each test's own (tokenizer_cache.py), never the user's,
and never one another's."""
from __future__ import annotations

from pathlib import Path

import pytest

from moe_serve.engine.gguf.tokenizer_cache import CACHE_DIR_ENV


@pytest.fixture(autouse=True)
def tokenizer_cache_dir(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The cache dir of this test, its processes (moe-generate) included."""
    path = tmp_path_factory.mktemp("cache")
    monkeypatch.setenv(CACHE_DIR_ENV, str(path))
    return path
