"""Benchmark prompts from the default model's held-out text: stdlib files it never trained on.

The held-out split is the training script's (scripts/stdlib_corpus.py) over the corpus file the
model was trained from, so the same files are held out on any machine whatever its Python;
the device call carries that file (`.out/default-model/stdlib-corpus.jsonl.xz`).
Each prompt is `length` tokens starting a third of the way into one held-out file (past the
licence header and module docstring), files taken in path order.
"""
from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / ".out" / "default-model" / "stdlib-corpus.jsonl.xz"
sys.path.insert(0, str(REPO / "scripts"))
import stdlib_corpus as corpus  # noqa: E402  (a sibling script, not a package)


def heldout_prompts(tokenizer_dir: str | Path, count: int, length: int, corpus_path: Path = CORPUS) -> list[list[int]]:
    from transformers import AutoTokenizer

    if not corpus_path.is_file():
        raise FileNotFoundError(f"{corpus_path} missing: run `python scripts/train_default_model.py prepare` "
                                "or carry .out/default-model to the device")
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    heldout = corpus.split(corpus.read_corpus(corpus_path), "heldout")
    prompts = []
    for doc in heldout:
        ids = tokenizer(doc.text, add_special_tokens=False)["input_ids"]
        start = len(ids) // 3
        if len(ids) - start >= length:
            prompts.append(ids[start : start + length])
        if len(prompts) == count:
            return prompts
    raise ValueError(f"only {len(prompts)} held-out files have {length} tokens past their first third")
