"""A tiny byte-level BPE tokenizer with a ChatML chat template, written next to a tiny checkpoint.

Byte-level so any token sequence decodes (and random ones split multi-byte characters, which
is what the detokenisation tests need); trained on text with accents, CJK and emoji.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog. " * 3,
    "Once upon a time there was a tiny mixture of experts model that served requests.",
    "café naïve façade 日本語のテキスト 中文 🙂🚀✨ ünïcödé Ελληνικά русский",
]


def build_tiny_tokenizer(path: Path, vocab_size: int) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) into path."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
