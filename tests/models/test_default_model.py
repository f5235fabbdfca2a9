"""The shipped default target and draft: standard HF directories that load, run and agree."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import stdlib_corpus  # noqa: E402
TARGET_DIR = REPO / "moe_serve" / "models" / "default"
DRAFT_DIR = REPO / "moe_serve" / "models" / "default-draft"
PROMPT = "import os\n\n\ndef read_lines(path):\n"


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TARGET_DIR)


@pytest.fixture(scope="module")
def models():
    return {d.name: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
            for d in (TARGET_DIR, DRAFT_DIR)}


def test_architectures_and_shared_shape(models):
    target, draft = models["default"].config, models["default-draft"].config
    assert target.model_type == "qwen3_moe" and draft.model_type == "qwen3"
    assert target.num_experts >= 8 and target.num_experts_per_tok >= 2
    assert target.hidden_size == draft.hidden_size
    assert target.vocab_size == draft.vocab_size
    assert draft.num_hidden_layers <= target.num_hidden_layers


def test_every_file_fits_the_budget():
    files = [p for d in (TARGET_DIR, DRAFT_DIR) for p in d.iterdir() if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 40 * 10**6
    assert all(p.stat().st_size < 16 * 2**20 for p in files if p.suffix == ".safetensors")


@pytest.mark.parametrize("name", ["default", "default-draft"])
def test_finite_logits_and_greedy_generation(models, tokenizer, name):
    model = models[name]
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids  # [1, P]
    with torch.no_grad():
        logits = model(ids).logits  # [1, P, V]
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert out.shape[1] > ids.shape[1]
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_draft_and_target_share_the_tokenizer(tokenizer):
    draft_tok = AutoTokenizer.from_pretrained(DRAFT_DIR)
    assert draft_tok.get_vocab() == tokenizer.get_vocab()
    assert draft_tok.chat_template == tokenizer.chat_template


def test_tokenizer_round_trips(tokenizer):
    text = "class Foo:\n\tdef bar(self, x=1):  # héllo, 世界 😀\n        return {'a': [x]}\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens(tokenizer):
    assert tokenizer.eos_token == "<|endoftext|>"
    assert tokenizer.pad_token == "<|pad|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert len(tokenizer.encode("<|im_start|>")) == 1


def test_chat_template_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\n")


def test_chat_template_renders_tools_and_tool_turns_in_hermes_style(tokenizer):
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call, call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
                {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(tools[0]) + "\n</tools>" in text
    tool_call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert text.endswith(f"<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n{tool_call}\n{tool_call}<|im_end|>\n"
                         "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
                         "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_is_the_one_the_training_scripts_write(tokenizer):
    assert tokenizer.chat_template == stdlib_corpus.CHAT_TEMPLATE


def test_generation_config_stops_at_both_ends(models, tokenizer):
    eos = models["default"].generation_config.eos_token_id
    assert set(eos) == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
