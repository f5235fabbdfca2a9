"""GGUF files, llama.cpp's one-file checkpoints, served as they are: `--model path/to/file.gguf`.

config.py derives the model's config from the file's metadata, checkpoint.py maps its tensor
names and reads its tensors for the loader (routed experts kept in their GGML block type, through
experts/formats/ggml_block.py, everything else dequantized), and transformers builds the
tokenizer from the file's tokenizer.ggml.* metadata (`tokenizer_source`).
"""
from __future__ import annotations

from pathlib import Path

SUFFIX = ".gguf"


def is_gguf(path: str | Path) -> bool:
    """Whether a --model (or --draft, --tokenizer) value names a GGUF file rather than a folder."""
    return Path(path).suffix.lower() == SUFFIX


def tokenizer_source(path: str | Path) -> tuple[str, dict[str, str]]:
    """AutoTokenizer.from_pretrained's folder and extra arguments for the tokenizer of a checkpoint
    folder (as it is) or of a GGUF file (its folder, and gguf_file= its name)."""
    if not is_gguf(path):
        return str(path), {}
    return str(Path(path).parent), {"gguf_file": Path(path).name}
