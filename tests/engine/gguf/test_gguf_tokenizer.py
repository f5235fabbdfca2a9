"""A GGUF file's tokenizer (its tokenizer.ggml.* metadata, which transformers builds a tokenizer from)
serves the model: the server's Tokenizer round-trips text and renders the file's chat template,
and moe-generate runs a GGUF MoE model from a text prompt."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.server.tokenizer import Tokenizer
from tests.cli_runs import run_cli
from tests.engine.gguf.gguf_tokenizers import EOS, TOKENS, gguf_with_tokenizer


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gguf_with_tokenizer("qwen2", tmp_path_factory.mktemp("gguf"), expert_type="Q8_0", weight_type="Q8_0")


def test_the_files_tokenizer_round_trips_and_renders_its_chat_template(gguf_file: Path) -> None:
    tokenizer = Tokenizer(str(gguf_file))
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    assert [TOKENS[i] for i in ids] == ["hello", "Ġworld"]
    assert tokenizer.decode(ids) == "hello world"
    assert tokenizer.eos_token_ids == (EOS,) and tokenizer.has_chat_template
    prompt = tokenizer.chat_prompt_ids([{"role": "user", "content": "hello"}])
    expected = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(prompt, skip_special_tokens=False) == expected


def test_moe_generate_runs_a_gguf_from_a_text_prompt(gguf_file: Path) -> None:
    result = run_cli("moe-generate", str(gguf_file), "--prompt", "hello world", "--max-tokens", "4", "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert 1 <= len(out["token_ids"]) <= 4 and isinstance(out["text"], str)
