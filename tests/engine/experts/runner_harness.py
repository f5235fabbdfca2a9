"""Helpers shared by the CachedExpertRunner tests: routers for its predictors, and a forward loop."""
from __future__ import annotations

import torch


def router_weights(store, seed: int = 1) -> list[torch.Tensor]:
    """Random routers [E, H] per layer, for the next-layer predictor and the stream's guess."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(store.num_experts, store.layout.hidden_size, generator=gen, dtype=torch.float64)
            for _ in range(store.num_layers)]


def drive(runner, store, make_routing, reference, steps: int, tokens: int, top_k: int, seed: int = 0) -> int:
    """Run `steps` forwards over every layer, compare with the reference; return expert accesses."""
    gen = torch.Generator().manual_seed(seed)
    accesses = 0
    for _ in range(steps):
        for layer in range(store.num_layers):
            x = torch.randn(tokens, store.layout.hidden_size, generator=gen, dtype=torch.float64)  # [T, H]
            routing = make_routing(layer, tokens, store.num_experts, top_k, gen)
            torch.testing.assert_close(runner.run(x, routing), reference(store, x, routing), rtol=0, atol=1e-12)
            accesses += routing.expert_ids.unique().numel()
        runner.finish_step()
    return accesses
