"""MoE routing details: SS-MoE top-r against a reference built from transformers' own modules,
the attention-output hook, and router weights for predictors."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve.engine.experts.routing import LayerRouting
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.loader import LoadedModel, load_model
from moe_serve.engine.models.blocks import MoEBlock, route
from moe_serve.engine.experts.routing import Router
from tests.tiny_checkpoints import AllResidentRunner, build_tiny_checkpoint, tiny_hf_model


class RecordingRunner(AllResidentRunner):
    def __init__(self, store) -> None:
        super().__init__(store)
        self.routings: list[LayerRouting] = []

    def run(self, x: torch.Tensor, routing: LayerRouting) -> torch.Tensor:
        self.routings.append(routing)
        return super().run(x, routing)


def _load(family: str, tmp_path: Path) -> LoadedModel:
    path = build_tiny_checkpoint(family, tmp_path / family)
    return load_model(path, runner_factory=lambda store, config: RecordingRunner(store), progress=False)


def _reference_top_r(hf_block: torch.nn.Module, x: torch.Tensor, r: int, normalize: bool) -> torch.Tensor:
    """transformers' router weights, experts and shared expert, but keeping only the r best experts."""
    probs = torch.softmax(x @ hf_block.gate.weight.T, dim=-1)  # [T, E]
    weights, ids = probs.topk(r, dim=-1)
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    out = hf_block.experts(x, ids, weights)  # [T, H]
    if hasattr(hf_block, "shared_expert"):
        out = out + torch.sigmoid(hf_block.shared_expert_gate(x)) * hf_block.shared_expert(x)
    return out


@pytest.mark.parametrize(("family", "normalize"), [("mixtral", True), ("qwen2_moe", False), ("olmoe", False)])
def test_top_r_routes_to_the_best_r_experts_and_keeps_the_shared_expert(family: str, normalize: bool, tmp_path: Path) -> None:
    model, _, config = _load(family, tmp_path)
    hf = tiny_hf_model(family)
    layer = config.moe_layers[0]
    ours: MoEBlock = model.layers[layer].mlp
    x = torch.randn(5, config.hidden_size, generator=torch.Generator().manual_seed(0))  # [T, H]
    with torch.no_grad():
        for r in (1, 2):
            expected = _reference_top_r(hf.model.layers[layer].mlp, x, r, normalize)
            torch.testing.assert_close(ours(x, model.runner, r), expected, atol=1e-5, rtol=0)
    assert model.runner.routings[-2].expert_ids.shape == (5, 1)


def test_forward_with_top_r_at_least_top_k_equals_full_routing(tmp_path: Path) -> None:
    model, _, config = _load("qwen3_moe", tmp_path)
    ids = torch.arange(3, 12)
    full = model(ids, 0, KVCache.for_model(config, 16, device="cpu", dtype=torch.float32))
    capped = model(ids, 0, KVCache.for_model(config, 16, device="cpu", dtype=torch.float32), moe_top_r=config.top_k)
    torch.testing.assert_close(full, capped, atol=0, rtol=0)
    top1 = model(ids, 0, KVCache.for_model(config, 16, device="cpu", dtype=torch.float32), moe_top_r=1)
    assert not torch.allclose(full, top1)
    routing = model.runner.routings[-1]
    assert routing.expert_ids.shape == (9, 1)
    torch.testing.assert_close(routing.expert_weights, torch.ones(9, 1))  # qwen3_moe here renormalises
    torch.testing.assert_close(routing.router_probs.sum(-1), torch.ones(9))


def test_route_normalises_only_when_the_family_does() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    ids, raw, probs = route(logits, 2, normalize=False)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(raw, probs[:, :2])
    _, normed, _ = route(logits, 2, normalize=True)
    torch.testing.assert_close(normed, raw / raw.sum())


def test_grouped_routing_picks_only_inside_the_best_groups() -> None:
    """DeepSeek-V2's group-limited greedy scores a group by its best expert; V3's by its best two
    (with the correction bias), and the bias picks experts without weighing them."""
    logits = torch.tensor([[3.0, -5.0, 2.9, 2.8, 1.0, 0.9, -4.0, -4.0]])  # groups of 2: (0 1) (2 3) (4 5) (6 7)
    v2 = Router("softmax", groups=4, topk_groups=1, group_score="max", scaling=2.0)
    ids, weights, probs = route(logits, 2, normalize=False, router=v2)
    assert ids.tolist() == [[0, 1]]  # group (0 1) holds the best expert: expert 2 lies outside it
    torch.testing.assert_close(weights, 2.0 * probs.gather(1, ids))
    v3 = Router("sigmoid", groups=4, topk_groups=1, group_score="top2", correction_bias=True, scaling=2.5)
    ids, weights, probs = route(logits, 2, normalize=True, router=v3)
    assert ids.tolist() == [[2, 3]]  # by its best two, group (2 3) beats (0 1)
    torch.testing.assert_close(probs, torch.sigmoid(logits))
    torch.testing.assert_close(weights, 2.5 * probs[:, 2:4] / probs[:, 2:4].sum())
    correction = torch.tensor([0.0, 0.0, 0.0, 0.0, 3.0, 3.0, 0.0, 0.0])
    ids, biased, _ = route(logits, 2, normalize=True, router=v3, correction=correction)
    assert ids.tolist() == [[4, 5]]
    torch.testing.assert_close(biased, 2.5 * probs[:, 4:6] / probs[:, 4:6].sum())  # weighed without the bias


def test_attention_hook_sees_each_layer_once_in_order_without_changing_logits(tmp_path: Path) -> None:
    model, _, config = _load("qwen2_moe", tmp_path)
    ids = torch.arange(3, 10)
    seen: list[tuple[int, tuple[int, ...]]] = []
    plain = model(ids, 0, KVCache.for_model(config, 16, device="cpu", dtype=torch.float32))
    hooked = model(
        ids, 0, KVCache.for_model(config, 16, device="cpu", dtype=torch.float32),
        on_attention_output=lambda layer, h: seen.append((layer, tuple(h.shape))),
    )
    assert seen == [(i, (7, config.hidden_size)) for i in range(config.num_layers)]
    torch.testing.assert_close(plain, hooked, atol=0, rtol=0)


def test_router_weights_are_the_checkpoint_routers_in_moe_layer_order(tmp_path: Path) -> None:
    model, _, config = _load("qwen3_moe", tmp_path)
    hf = tiny_hf_model("qwen3_moe")
    weights = model.router_weights()
    assert config.moe_layers == (1, 3)
    assert len(weights) == config.num_moe_layers
    for w, layer in zip(weights, config.moe_layers):
        torch.testing.assert_close(w, hf.model.layers[layer].mlp.gate.weight, atol=0, rtol=0)


def test_moe_model_without_runner_is_refused() -> None:
    from moe_serve.engine.models.blocks import CausalLM
    from moe_serve.engine.models.config import ModelConfig

    config = ModelConfig.from_hf({**tiny_hf_model("mixtral").config.to_dict(), "architectures": ["MixtralForCausalLM"]})
    with pytest.raises(ValueError, match="ExpertRunner"):
        CausalLM(config, None)
