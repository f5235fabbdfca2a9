"""EngineConfig's derived settings."""
from __future__ import annotations

import pytest

from engine.config import EngineConfig


@pytest.mark.parametrize(("policy", "spec", "in_force"), [
    ("auto", "off", "lru"), ("auto", "self", "next-use"), ("auto", "draft", "next-use"),
    ("mrs", "draft", "mrs"), ("lru", "self", "lru"),
])
def test_auto_cache_policy_is_next_use_only_under_speculative_decoding(policy: str, spec: str, in_force: str) -> None:
    assert EngineConfig(model="m", cache_policy=policy, spec=spec).eviction_policy == in_force
