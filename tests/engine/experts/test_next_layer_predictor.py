"""Next-layer predictor: impact ranking, the tasks it submits, and its accuracy counter."""
from __future__ import annotations

import torch

from engine.experts.predictor import NextLayerPredictor, rank_by_impact, token_topk
from engine.experts.prefetch import PrefetchTask
from engine.experts.stats import ExpertStats


def test_rank_by_impact_is_the_union_ordered_by_summed_probability() -> None:
    ids = torch.tensor([[3, 1], [1, 0]])
    probs = torch.tensor([[0.5, 0.2], [0.4, 0.3]])  # impact: 1 -> 0.6, 3 -> 0.5, 0 -> 0.3
    assert rank_by_impact(probs, ids, num_experts=6, limit=5).tolist() == [1, 3, 0, -1, -1]
    assert rank_by_impact(probs, ids, num_experts=6, limit=2).tolist() == [1, 3]


def test_token_topk_is_top_k_of_the_router_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 5, generator=gen), torch.randn(7, 5, generator=gen)
    probs, ids = token_topk(x, weight, k=2)
    full = torch.softmax(x @ weight.T, dim=-1)  # [T, E]
    torch.testing.assert_close(probs, full.topk(2, dim=-1).values)
    assert torch.equal(ids, full.topk(2, dim=-1).indices)


def test_predict_submits_one_task_per_later_layer_and_scores_itself() -> None:
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(8, 4, generator=gen) for _ in range(4)]
    tasks: list[PrefetchTask] = []
    stats = ExpertStats(4)
    predictor = NextLayerPredictor(weights, top_k=2, depth=2, submit=tasks.append, stats=stats)
    x = torch.randn(1, 4, generator=gen)
    guess = predictor.predict(layer=1, x=x, run_index=10)
    assert [(t.layer, t.due) for t in tasks] == [(2, 11), (3, 12)]  # clipped at the last layer
    probs, ids = guess
    assert tasks[0].experts.tolist() == ids[0].tolist() + [-1, -1]  # one token: its top-2, padded to 2k
    assert predictor.predict(layer=3, x=x, run_index=12) is None
    predictor.record_used(2, [ids[0, 0].item(), 7 if ids[0, 1].item() != 7 else 6])
    predictor.record_used(0, [1, 2])  # no guess for layer 0: not counted
    per_layer = stats.snapshot().per_layer
    assert (per_layer[2].predicted_correct, per_layer[2].predicted_needed) == (1, 2)
    assert per_layer[2].predictor_accuracy == 0.5 and per_layer[0].predicted_needed == 0
