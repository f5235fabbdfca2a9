"""gpt-oss's tokenizer (o200k_harmony) built offline, and the vocabulary openai-harmony loads.

openai-harmony downloads the o200k_base BPE file on first use; litellm (a test dependency)
bundles that very file under the name harmony's cache gives it (the sha1 of its URL), so pointing
TIKTOKEN_RS_CACHE_DIR at litellm's folder loads harmony without a network. The Hugging Face
tokenizer is the same BPE converted by transformers, with harmony's special tokens at their ids
(199998 <|startoftext|> to 201087, the named ones among reserved ones), as gpt-oss ships it.
"""
from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from openai_harmony import HarmonyEncoding

O200K_BASE_FILE = "fb374d419588a4632f3f557e76b4b70aebbca790"  # the sha1 of its URL: harmony's cache name
# o200k's pre-tokenizer regex, as tiktoken_ext.openai_public writes it
O200K_PATTERN = (
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|"""
    r"""\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
FIRST_SPECIAL, VOCAB_SIZE = 199998, 201088
EOS_TOKEN = "<|return|>"


def bundled_vocabulary_dir() -> Path:
    """litellm's folder holding o200k_base, found without importing litellm (which takes seconds)."""
    spec = importlib.util.find_spec("litellm")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("litellm (the test extra) bundles the o200k_base vocabulary harmony needs offline")
    return Path(spec.submodule_search_locations[0]) / "litellm_core_utils" / "tokenizers"


def use_bundled_vocabulary() -> None:
    """Point openai-harmony (here and in servers started from here) at the bundled vocabulary,
    unless the environment already says where it is."""
    os.environ.setdefault("TIKTOKEN_RS_CACHE_DIR", str(bundled_vocabulary_dir()))


def build_gpt_oss_tokenizer(path: Path, harmony: HarmonyEncoding) -> None:
    """Write tokenizer.json + tokenizer_config.json of o200k_harmony to path (about 3 s); harmony names
    the special tokens."""
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # added in id order after the 199998 BPE tokens, so each lands on its id
    specials = [harmony.decode([i]) for i in range(FIRST_SPECIAL, VOCAB_SIZE)]
    tokenizer = TikTokenConverter(vocab_file=str(bundled_vocabulary_dir() / O200K_BASE_FILE), pattern=O200K_PATTERN,
                                  extra_special_tokens=specials).converted()
    assert tokenizer.get_vocab_size() == VOCAB_SIZE
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|startoftext|>", "eos_token": EOS_TOKEN,
              "pad_token": "<|endoftext|>", "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

