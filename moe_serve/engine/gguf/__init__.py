"""GGUF files, llama.cpp's one-file checkpoints, served as they are: `--model path/to/file.gguf`.

reader.py reads a file's metadata and tensor table, config.py derives the model's config from the
metadata, checkpoint.py maps its tensor names and reads its tensors for the loader (routed experts
kept in their GGML block type, through experts/formats/ggml_block.py, everything else dequantized),
and transformers builds the tokenizer from the file's tokenizer.ggml.* metadata, once per file:
tokenizer_cache.py keeps it for every later load (`tokenizer_source`).
"""
from __future__ import annotations

from pathlib import Path

SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """Whether a --model (or --draft, --tokenizer) value names a GGUF file rather than a folder."""
    return Path(path).suffix.lower() == SUFFIX


def tokenizer_source(path: str | Path) -> tuple[str, dict[str, str]]:
    """AutoTokenizer.from_pretrained's folder and extra arguments for the tokenizer of a checkpoint
    folder (as it is) or of a GGUF file (its tokenizer's folder in the cache, converted on a miss)."""
    if not is_gguf(path):
        return str(path), {}
    from moe_serve.engine.gguf.tokenizer_cache import cached_tokenizer_source

    return cached_tokenizer_source(Path(path))


def load_tokenizer(path: str | Path, trust_remote_code: bool):
    """The transformers tokenizer of a checkpoint folder or GGUF file (tokenizer_source's); transformers
    is imported here, so that code which never meets a tokenizer never pays for it."""
    from transformers import AutoTokenizer

    folder, kwargs = tokenizer_source(path)
    return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **kwargs)
