"""An ExpertStore of random weights and random routings, for the expert-side tests.

float64 weights so that "the cache never changes the math" can be checked to ~1e-12: only the
order in which the k expert outputs of a token are summed differs from the reference.
"""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from moe_serve.engine.experts.compute import accumulate_experts
from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.experts.store import ExpertStore


def random_store(num_layers: int = 4, num_experts: int = 8, hidden: int = 16, inter: int = 8,
                 seed: int = 0) -> ExpertStore:
    layout = ExpertLayout(hidden_size=hidden, intermediate_size=inter, dtype=torch.float64)
    store = ExpertStore(num_layers, num_experts, layout)
    gen = torch.Generator().manual_seed(seed)
    store.rows.copy_(torch.randn(store.rows.shape, generator=gen, dtype=torch.float64) / hidden**0.5)
    return store


def random_routing(layer: int, tokens: int, num_experts: int, top_k: int, gen: torch.Generator) -> LayerRouting:
    logits = torch.randn(tokens, num_experts, generator=gen, dtype=torch.float64)
    probs = logits.softmax(dim=-1)  # [T, E]
    weights, ids = probs.topk(top_k, dim=-1)
    return LayerRouting(layer=layer, expert_ids=ids, expert_weights=weights / weights.sum(-1, keepdim=True),
                        router_probs=probs)


def reference_output(store: ExpertStore, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
    """Every expert straight from the store: what any cache configuration must reproduce."""
    rows = {e: store.row(routing.layer, e) for e in range(store.num_experts)}
    out = torch.zeros_like(x)
    accumulate_experts(out, x, routing.expert_ids, routing.expert_weights, rows, store.layout)
    return out


@pytest.fixture
def store() -> ExpertStore:
    return random_store()


@pytest.fixture
def make_store() -> Callable[..., ExpertStore]:
    return random_store


@pytest.fixture
def make_routing() -> Callable[..., LayerRouting]:
    return random_routing


@pytest.fixture
def reference() -> Callable[[ExpertStore, torch.Tensor, LayerRouting], torch.Tensor]:
    return reference_output
