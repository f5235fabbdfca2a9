"""A GGUF file's tokenizer, built by transformers from the file's tokenizer.ggml.* metadata once, and
kept as a Hugging Face tokenizer folder that every later load reads.

Building it is slow: for the architectures served here transformers parses the whole file with
the gguf package's reader before it reads the vocabulary (6-12 s and ~0.5 GB at a 151k vocabulary),
and the server built it at every start, the engine again for llguidance (at its first structured
output), moe-generate once more. Loading the saved tokenizer.json of that vocabulary takes 0.6 s.

The folder is `<cache dir>/gguf-tokenizers/<file stem>-<key>`, the key hashing what the tokenizer
is made from: the file's absolute path, size and mtime (a file replaced or rewritten in place gets
a new entry; hashing its gigabytes of contents would cost more than converting), transformers'
version (its conversion changes between versions) and CONVERSION, this module's way of saving. The
cache dir is $MOE_SERVE_CACHE_DIR, else $XDG_CACHE_HOME/moe_serve, else ~/.cache/moe_serve. An entry
is written to a temporary folder beside it and renamed into place, so a process starting at the
same time finds a complete folder or none; when two convert at once, the first rename wins and the
other drops its copy.

The folder names the generic TokenizersBackend as its class: from tokenizer.json a model's own
class (Qwen2Tokenizer) rebuilds its default pipeline around the vocabulary and merges, which is not
the pipeline transformers built from the GGUF (Qwen's adds an NFC normalizer the GGUF's has not),
while the generic class loads tokenizer.json as written. So encoding, decoding, special tokens and
chat template are what loading the GGUF gives; as in any saved tokenizer, add_bos_token and
add_eos_token live in tokenizer.json's post-processor, not as flags.

Where no entry can be written (a read-only cache dir) the GGUF file stays the source, as without a
cache: each load converts it. Where transformers cannot build the tokenizer, whatever it raises
(a file with no vocabulary: KeyError; any gpt-oss file, whose rope.scaling keys transformers 5
misreads: TypeError) is a ValueError naming it, the error the CLIs answer with --tokenizer DIR's hint.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

CACHE_DIR_ENV = "MOE_SERVE_CACHE_DIR"
CONVERSION = 1  # raise when what an entry holds changes, so that older entries are not read
TokenizerSource = tuple[str, dict[str, str]]  # AutoTokenizer.from_pretrained's folder and extra arguments

log = logging.getLogger(__name__)


def cache_dir() -> Path:
    if os.environ.get(CACHE_DIR_ENV):
        return Path(os.environ[CACHE_DIR_ENV])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moe_serve"


class TokenizerNotBuilt(ValueError):
    """transformers cannot build the tokenizer of a GGUF file."""


def cached_tokenizer_source(gguf: Path) -> TokenizerSource:
    """The tokenizer folder of a GGUF file, converted and cached on the first call; the file itself
    where it cannot be cached. TokenizerNotBuilt where transformers cannot build it."""
    try:
        entry = _entry(gguf)
        if not entry.is_dir():
            log.info("building the tokenizer of %s once, into %s", gguf, entry)
            _save(_converted(gguf), entry)
    except TokenizerNotBuilt:
        raise
    except Exception as exc:  # no such file, a read-only cache dir, ...
        log.warning("the tokenizer of %s is not cached (%s): it is built from the file on each load", gguf, exc)
        return _in_file(gguf)
    return str(entry), {}


def _in_file(gguf: Path) -> TokenizerSource:
    return str(gguf.parent), {"gguf_file": gguf.name}


def _entry(gguf: Path) -> Path:
    path = gguf.resolve()
    stat = path.stat()
    made_from = [CONVERSION, version("transformers"), str(path), stat.st_size, stat.st_mtime_ns]
    key = hashlib.sha256(json.dumps(made_from).encode()).hexdigest()[:16]
    return cache_dir() / "gguf-tokenizers" / f"{path.stem}-{key}"


def _converted(gguf: Path):
    from transformers import AutoTokenizer

    folder, kwargs = _in_file(gguf)
    try:
        return AutoTokenizer.from_pretrained(folder, **kwargs)
    except Exception as exc:  # building it again from the file, in the caller, would fail the same way
        raise TokenizerNotBuilt(f"transformers cannot build the tokenizer of this GGUF file ({type(exc).__name__}: "
                                f"{str(exc).rstrip('.')})") from exc


def _save(tokenizer, entry: Path) -> None:
    entry.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        tokenizer.save_pretrained(staging)
        config_file = staging / "tokenizer_config.json"
        config = json.loads(config_file.read_text())
        config_file.write_text(json.dumps({**config, "tokenizer_class": "TokenizersBackend"}, indent=2))
        try:
            staging.rename(entry)
        except OSError:
            if not entry.is_dir():  # else another process's entry, renamed into place first
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # nothing left there after the rename
