"""bench/structured_mask.py on the CPU at tiny sizes: its mask walks and engine rounds run through
the engine's own MaskFiller and EngineCore as they are now (no test ran it before, and a renamed
method once broke it unseen)."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from bench import structured_mask
from moe_serve.engine.structured import Grammars


@pytest.mark.parametrize("batch", [1, 4])
def test_mask_walks_take_only_tokens_their_grammar_accepts(batch: int) -> None:
    tokenizer = AutoTokenizer.from_pretrained(structured_mask.DEFAULT_MODEL)
    grammars = Grammars(lambda: tokenizer, len(tokenizer))
    # a token the masks allowed but the matcher refused would fail the next step's masks (GrammarError)
    result = structured_mask.bench_masks(grammars, batch, 6, torch.device("cpu"), len(tokenizer))
    assert result["batch"] == batch and result["steps"] == 6
    assert result["fill_us_per_step"] > 0 and result["follow_us_per_step"] > 0


def test_engine_rounds_time_constrained_and_plain_runs_of_the_same_length(monkeypatch) -> None:
    monkeypatch.setattr(structured_mask, "ARRAY_ITEMS", 3)
    monkeypatch.setattr(structured_mask, "ENGINE_ROUNDS", 2)
    result = structured_mask.bench_engine(str(structured_mask.DEFAULT_MODEL), "cpu", 2)
    # three one-digit items: "[", three digits, two commas, "]" at one token each at least
    assert result["tokens"] >= 7
    constrained, plain = result["steps_timed"]
    assert constrained > 0 and plain > 0
    assert len(result["round_ratios"]) == 2 and result["ratio"] > 0
