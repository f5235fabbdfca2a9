"""Next-layer predictor: impact ranking, the guess it launches, and its accuracy counter."""
from __future__ import annotations

import torch

from moe_serve.engine.experts.predictor import NextLayerPredictor, rank_by_impact, token_topk
from moe_serve.engine.experts.routing import Router
from moe_serve.engine.experts.stats import ExpertStats
from moe_serve.engine.models.blocks import route


def test_rank_by_impact_is_the_union_ordered_by_summed_probability() -> None:
    ids = torch.tensor([[3, 1, 1, 0], [2, 2, 5, 4]])  # per target layer: two tokens' top-2
    probs = torch.tensor([[0.5, 0.2, 0.4, 0.3], [0.1, 0.1, 0.6, 0.7]])  # first: 1 -> 0.6, 3 -> 0.5, 0 -> 0.3
    assert rank_by_impact(probs, ids, num_experts=6, limit=5).tolist() == [[1, 3, 0, -1, -1], [4, 5, 2, -1, -1]]
    assert rank_by_impact(probs, ids, num_experts=6, limit=2).tolist() == [[1, 3], [4, 5]]


def test_token_topk_is_top_k_of_the_router_softmax() -> None:
    gen = torch.Generator().manual_seed(0)
    x, weight = torch.randn(3, 5, generator=gen), torch.randn(7, 5, generator=gen)
    probs, ids = token_topk(x, weight, k=2)
    full = torch.softmax(x @ weight.T, dim=-1)  # [T, E]
    torch.testing.assert_close(probs, full.topk(2, dim=-1).values)
    assert torch.equal(ids, full.topk(2, dim=-1).indices)


def test_guess_covers_the_later_layers_and_scores_itself() -> None:
    gen = torch.Generator().manual_seed(1)
    weights = [torch.randn(8, 4, generator=gen) for _ in range(4)]
    stats = ExpertStats(4)
    predictor = NextLayerPredictor(weights, top_k=2, depth=2, stats=stats)
    x = torch.randn(1, 4, generator=gen)
    guess = predictor.guess(layer=1, x=x)
    assert list(guess.targets) == [2, 3]  # clipped at the last layer
    for target, row in zip(guess.targets, guess.ranked.tolist()):  # one token: its top-2
        assert row == token_topk(x, weights[target], 2)[1][0].tolist()
    probs, ids = guess.next_layer()
    torch.testing.assert_close(probs, token_topk(x, weights[2], 2)[0])
    assert predictor.guess(layer=3, x=x) is None
    wanted = predictor.remember(guess, [ids[0].tolist(), [6, -1]])  # as read back on the host
    assert wanted == [(2, e) for e in ids[0].tolist()] + [(3, 6)]  # -1 pads nothing
    predictor.record_used(2, [ids[0, 0].item(), 7 if ids[0, 1].item() != 7 else 6])
    predictor.record_used(0, [1, 2])  # no guess for layer 0: not counted
    per_layer = stats.snapshot().per_layer
    assert (per_layer[2].predicted_correct, per_layer[2].predicted_needed) == (1, 2)
    assert per_layer[2].predictor_accuracy == 0.5 and per_layer[0].predicted_needed == 0


def test_guess_for_several_tokens_ranks_their_union_by_impact() -> None:
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(8, 4, generator=gen) for _ in range(3)]
    predictor = NextLayerPredictor(weights, top_k=2, depth=1, stats=ExpertStats(3), max_per_layer=3)
    x = torch.randn(5, 4, generator=gen)
    probs, ids = token_topk(x, weights[1], 2)  # [T, k]
    expected = rank_by_impact(probs.reshape(1, -1), ids.reshape(1, -1), num_experts=8, limit=3)
    assert torch.equal(predictor.guess(layer=0, x=x).ranked, expected)


def test_guess_chooses_as_a_grouped_corrected_router_does() -> None:
    """DeepSeek-V3 / GLM-4.5 routing: the guess is what the target layer's router itself picks from x
    (sigmoid scores plus its correction bias, within the best groups), not a softmax top-k."""
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(8, 4, generator=gen) for _ in range(3)]
    corrections = [torch.randn(8, generator=gen) for _ in range(3)]
    router = Router("sigmoid", groups=4, topk_groups=2, group_score="top2", correction_bias=True, scaling=2.5)
    predictor = NextLayerPredictor(weights, top_k=2, depth=2, stats=ExpertStats(3), router=router,
                                   corrections=corrections)
    x = torch.randn(3, 4, generator=gen)
    guess = predictor.guess(layer=0, x=x)
    for j, target in enumerate(guess.targets):
        ids, _, scores = route(x @ weights[target].T, 2, normalize=False, router=router, correction=corrections[target])
        assert torch.equal(guess.top[1][:, j], ids)
        torch.testing.assert_close(guess.top[0][:, j], scores.gather(1, ids))
        assert torch.equal(token_topk(x, weights[target], 2, router, corrections[target])[1], ids)
    assert not torch.equal(token_topk(x, weights[1], 2)[1], guess.top[1][:, 0])  # the plain top-k differs here
