"""Tiny GGUF files with a tokenizer, its tokenizer.ggml.* metadata as llama.cpp's converter writes the
kinds the served families carry, each with a ChatML chat template:

    gguf_file = gguf_with_tokenizer("qwen2", tmp_path)

qwen2: byte-level BPE split by Qwen2's pre-tokenizer (Qwen2, Qwen3 and their MoEs); llama-bpe: byte-level
BPE on GGUF's llama (Llama 3); llama-spm: sentencepiece BPE with byte fallback, merges left to be
derived from the scores (Llama 2, Mixtral).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.gguf_checkpoints import gguf_pair

MERGES = ["Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "h e", "l l", "he ll", "hell o"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = [*bytes_to_unicode().values(), *(merge.replace(" ", "") for merge in MERGES), *SPECIALS]
EOS = TOKENS.index("<|im_end|>")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# sentencepiece's: unknown, BOS, EOS, a token per byte, then pieces, the better merges scoring higher
PIECES = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", "h", "e", "l", "o", "w", "r", "d",
          "he", "ll", "hell", "hello", "▁hello", "or", "ld", "▁w", "▁wor", "▁world"]
_UNKNOWN, _NORMAL, _CONTROL, _BYTE = 2, 1, 3, 6  # llama.cpp's token types


def _byte_level(pre_tokenizer: str) -> dict[str, Any]:
    return dict(tokenizer_model="gpt2", tokenizer_pre=pre_tokenizer, token_list=TOKENS, token_merges=MERGES,
                token_types=[_NORMAL] * (len(TOKENS) - len(SPECIALS)) + [_CONTROL] * len(SPECIALS),
                chat_template=CHAT_TEMPLATE)


_SENTENCEPIECE = dict(tokenizer_model="llama", tokenizer_pre="default", token_list=PIECES,
                      token_scores=[0.0] * 259 + [-float(i) for i in range(len(PIECES) - 259)],
                      token_types=[_UNKNOWN, _CONTROL, _CONTROL] + [_BYTE] * 256 + [_NORMAL] * (len(PIECES) - 259),
                      add_bos_token=True, chat_template=CHAT_TEMPLATE)
# kind -> (family, tokenizer metadata, its tokens, BOS, EOS)
KINDS = {
    "qwen2": ("qwen3_moe", _byte_level("qwen2"), TOKENS, "<|endoftext|>", "<|im_end|>"),
    "llama-bpe": ("mixtral", _byte_level("llama-bpe"), TOKENS, "<|endoftext|>", "<|im_end|>"),
    "llama-spm": ("mixtral", _SENTENCEPIECE, PIECES, "<s>", "</s>"),
}


def gguf_with_tokenizer(kind: str, dst: Path, **kwargs: Any) -> Path:
    """dst/model.gguf: a tiny model of the kind's family with that tokenizer (kwargs: gguf_pair's)."""
    family, tokenizer, tokens, bos, eos = KINDS[kind]
    path, _ = gguf_pair(family, dst, vocab_size=len(tokens), bos_token_id=tokens.index(bos),
                        eos_token_id=tokens.index(eos), tokenizer=tokenizer, **kwargs)
    return path
