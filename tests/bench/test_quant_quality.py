"""bench/quant_quality.py at tiny sizes (CPU): the report's arithmetic, windows only from held-out files,
and the one-sequence path it measures scoring and decoding as the batched engine does."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bench.prompts import corpus
from bench.quant_quality import DEFAULT_MODEL, agreement, greedy, heldout_windows, main, score_windows
from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore
from moe_serve.engine.messages import GenerateRequest, SamplingParams

MODEL = str(DEFAULT_MODEL)
CODE = "def area(width, height):\n    return width * height\n\n\nclass Box:\n    size = 3\n" * 12


def _paths(split: str, count: int) -> list[str]:
    """The first `count` made-up file names the corpus split puts in `split`."""
    names = (f"pkg/mod{i}.py" for i in range(10_000))
    return [n for n in names if corpus.split_of(n) == split][:count]


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory) -> Path:
    """Three held-out and two training files (the training ones of other text)."""
    docs = [corpus.Document(p, f"# {p}\n" + CODE) for p in _paths("heldout", 3)]
    docs += [corpus.Document(p, "import os\nprint(os.sep)\n" * 40) for p in _paths("train", 2)]
    path = tmp_path_factory.mktemp("corpus") / "stdlib-corpus.jsonl.xz"
    corpus.write_corpus(sorted(docs, key=lambda d: d.relpath), path)
    return path


def test_agreement_counts_identical_prefix_and_positions() -> None:
    got = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 3, 4], [5, 9, 7, 0]])
    assert got["identical_share"] == 0.5
    assert got["mean_matching_prefix"] == (4 + 1) / 2
    assert got["token_agreement"] == 6 / 8
    assert got["first_divergence"] == [None, 1]


def test_windows_come_from_held_out_files_only(tiny_corpus: Path) -> None:
    windows = heldout_windows(DEFAULT_MODEL, 200, 64, tiny_corpus)
    assert [len(w) for w in windows] == [64, 64, 64]
    from transformers import AutoTokenizer

    text = AutoTokenizer.from_pretrained(MODEL).decode([t for w in windows for t in w])
    assert text.startswith(f"# {min(_paths('heldout', 3))}\n") and "print(os.sep)" not in text
    with pytest.raises(ValueError, match="fewer than"):
        heldout_windows(DEFAULT_MODEL, 100_000, 64, tiny_corpus)


def test_one_sequence_path_scores_and_decodes_as_the_batched_engine(tiny_corpus: Path) -> None:
    """What the bench measures (Runtime.target, PlainDecoder) against EngineCore's batched prefill with
    prompt logprobs and its batched greedy decode, with int4 experts."""
    windows = heldout_windows(DEFAULT_MODEL, 96, 48, tiny_corpus)  # [2, 48]
    core = EngineCore(EngineConfig(model=MODEL, device="cpu", expert_quant="int4"))
    try:
        with torch.inference_mode():
            scores = score_windows(core.runtime, windows)
            solo = greedy(core.runtime, windows, 8)
        for i, w in enumerate(windows):
            core.add_request(GenerateRequest(f"r{i}", tuple(w), SamplingParams(max_tokens=8, temperature=0,
                                                                               prompt_logprobs=1)))
        tokens: dict[str, list[int]] = {"r0": [], "r1": []}
        logprobs: dict[str, list[float]] = {"r0": [], "r1": []}
        while core.has_unfinished():
            for out in core.step():
                assert out.error is None
                tokens[out.request_id] += out.new_token_ids
                logprobs[out.request_id] += [lp.logprob for lp in out.prompt_logprobs]
    finally:
        core.close()
    torch.testing.assert_close(torch.tensor(logprobs["r0"] + logprobs["r1"]), torch.tensor(scores["logprobs"]),
                               rtol=1e-4, atol=1e-4)
    assert [tokens["r0"], tokens["r1"]] == solo


def test_report_at_tiny_sizes(tiny_corpus: Path, tmp_path: Path) -> None:
    main(["--corpus", str(tiny_corpus), "--formats", "none,int8,int4", "--tokens", "128", "--seq-len", "64",
          "--files", "2", "--prompt-len", "16", "--new-tokens", "6", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "quant_quality.json").read_text())
    none, int8, int4 = report["rows"]
    assert [r["expert_quant"] for r in report["rows"]] == ["none", "int8", "int4"]
    assert all(r["scored_tokens"] == 2 * 63 for r in report["rows"])
    assert none["perplexity_vs_none"] == 0 and none["goal"] is None
    assert none["teacher_forced_top1_agreement"] == 1 and none["greedy"]["identical_share"] == 1
    assert math.isclose(none["perplexity"], math.exp(none["nll_per_token"]))
    assert int8["goal"]["max_increase"] == 0.01 and int4["goal"]["max_increase"] == 0.05
    assert int4["goal"]["met"] == (int4["perplexity"] <= 1.05 * none["perplexity"])
    assert int4["expert_bytes"] < int8["expert_bytes"] < none["expert_bytes"]
    assert all(len(c) == 6 for r in report["rows"] for c in r["continuations"])
    table = (tmp_path / "quant_quality.md").read_text()
    assert "Command: `python bench/quant_quality.py --corpus" in table and "GGUF" in table
    with pytest.raises(SystemExit):
        main(["--formats", "int8,none", "--out", str(tmp_path)])
