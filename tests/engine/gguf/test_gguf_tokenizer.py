"""A GGUF file's tokenizer (its tokenizer.ggml.* metadata, which transformers builds a tokenizer from)
serves the model: the server's Tokenizer round-trips text and renders the file's chat template,
and moe-generate runs a GGUF MoE model from a text prompt."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from moe_serve.server.tokenizer import Tokenizer
from tests.cli_runs import run_cli
from tests.gguf_checkpoints import gguf_pair

# a byte-level BPE as Qwen's GGUFs carry one: the 256 byte tokens, a few merges, ChatML specials
MERGES = ["Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "h e", "l l", "he ll", "hell o"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [*bytes_to_unicode().values(), *(merge.replace(" ", "") for merge in MERGES), *SPECIALS]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EOS = TOKENS.index("<|im_end|>")


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = dict(tokenizer_model="gpt2", tokenizer_pre="qwen2", token_list=TOKENS, token_merges=MERGES,
                     token_types=[1] * (len(TOKENS) - len(SPECIALS)) + [3] * len(SPECIALS), chat_template=CHAT_TEMPLATE)
    path, _ = gguf_pair("qwen3_moe", tmp_path_factory.mktemp("gguf"), expert_type="Q8_0", weight_type="Q8_0",
                        vocab_size=len(TOKENS), bos_token_id=TOKENS.index("<|endoftext|>"), eos_token_id=EOS,
                        tokenizer=tokenizer)
    return path


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
