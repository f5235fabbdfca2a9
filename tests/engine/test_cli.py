"""moe-generate: start-up failures in one line without a traceback; the flags it shares with moe-serve."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve.engine.cli import _parse_args
from tests.cli_runs import assert_one_line_failure, model_without_tokenizer, run_cli, unsupported_model


def test_missing_folder() -> None:
    result = run_cli("moe-generate", "--model", "/nope", "--prompt-ids", "1,2")
    assert_one_line_failure(result, "moe-generate", "/nope", "no such folder")


def test_empty_folder(tmp_path: Path) -> None:
    assert_one_line_failure(run_cli("moe-generate", str(tmp_path), "--prompt", "x"), "moe-generate", "is empty")


def test_unsupported_architecture(tmp_path: Path) -> None:
    result = run_cli("moe-generate", str(unsupported_model(tmp_path / "gpt2")), "--prompt-ids", "1")
    assert_one_line_failure(result, "moe-generate", "GPT2LMHeadModel")


def test_text_prompt_without_tokenizer(tmp_path: Path) -> None:
    result = run_cli("moe-generate", str(model_without_tokenizer(tmp_path / "bare")), "--prompt", "def f():")
    assert_one_line_failure(result, "moe-generate", "no tokenizer files", "--prompt-ids")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_but_absent() -> None:
    result = run_cli("moe-generate", "--device", "cuda", "--prompt-ids", "1")
    assert_one_line_failure(result, "moe-generate", "--device cuda")


def test_positional_model_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_ARG_MAX_MODEL_LEN", "128")
    args = _parse_args(["/some/model", "--prompt-ids", "1"])
    assert (args.model, args.max_model_len) == ("/some/model", 128)
    assert _parse_args(["--prompt-ids", "1", "--max-model-len", "64"]).max_model_len == 64  # the command line wins
