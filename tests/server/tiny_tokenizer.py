"""A tiny character-level tokenizer with byte fallback and a ChatML chat template.

The tiny checkpoints have a 128-token vocabulary, so this tokenizer fits in it: special tokens
at the ids the checkpoints use (1 = <|im_start|>, 2 = <|im_end|> = EOS), printable ASCII, and
<0xNN> byte tokens for the UTF-8 bytes of a few accented, CJK and emoji characters. Characters
arrive byte by byte, so detokenisation has multi-byte characters to keep whole, and a random
model emits broken byte sequences to test the same.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models

SPECIAL_TOKENS = ("<unk>", "<|im_start|>", "<|im_end|>")
EOS_TOKEN = "<|im_end|>"
MULTIBYTE = "éüñö日本中語🙂🚀✨"
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> dict[str, int]:
    chars = [c for c in string.printable if c.isprintable()] + ["\n"]
    byte_values = sorted({b for c in MULTIBYTE for b in c.encode("utf-8")})
    tokens = list(SPECIAL_TOKENS) + chars + [f"<0x{b:02X}>" for b in byte_values]
    return {token: i for i, token in enumerate(tokens)}


def build_tiny_tokenizer(path: Path) -> int:
    """Write tokenizer.json + tokenizer_config.json (with the chat template); returns the vocab size."""
    vocab = _vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "unk_token": "<unk>",
              "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return len(vocab)
