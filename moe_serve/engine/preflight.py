"""Start-up checks that fail in one line, before anything heavy loads: the model folder (there, a
Hugging Face checkpoint of a supported architecture with its weights and, where text is needed, its
tokenizer) or GGUF file, the draft's, the device and the context length. Each failure is a
ConfigError whose message the CLIs print as it is."""
from __future__ import annotations

import re
from pathlib import Path

from moe_serve.engine.config import ConfigError, EngineConfig, resolve_max_model_len
from moe_serve.engine.gguf import is_gguf
from moe_serve.engine.loader import LoadError, checkpoint_files, read_config
from moe_serve.engine.models.config import ModelConfig

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")  # owner/name, as Hugging Face hub ids are written


def check_engine_config(config: EngineConfig) -> None:
    """Everything about an EngineConfig that can be checked without loading weights."""
    model = check_model_dir(config.model, "--model")
    if config.spec == "draft":
        if not config.draft:
            raise ConfigError("--spec draft needs --draft DIR, a dense draft checkpoint")
        check_model_dir(config.draft, "--draft")
    check_device(config.device)
    resolve_max_model_len(config.max_model_len, model)


def check_model_dir(path: str, flag: str) -> ModelConfig:
    folder = Path(path)
    if is_gguf(path):
        if not folder.is_file():
            raise ConfigError(f"{flag} {path}: no such GGUF file")
    else:
        _check_folder(path, flag)
    try:
        model = read_config(folder)
        if not is_gguf(path):
            checkpoint_files(folder)
    except LoadError as exc:
        raise ConfigError(f"{flag} {path}: {exc}") from exc
    except KeyError as exc:
        raise ConfigError(f"{flag} {path}: config.json has no {exc}") from exc
    except ValueError as exc:  # unsupported architecture or option, config.json not JSON, or not a GGUF file
        raise ConfigError(f"{flag} {path}: {exc}") from exc
    return model


def _check_folder(path: str, flag: str) -> None:
    folder = Path(path)
    if not folder.exists():
        hint = ""
        if _HUB_ID.match(path):
            hint = (f"; only local folders are served: if {path} is a Hugging Face hub id, download it first "
                    f"(hf download {path} --local-dir DIR, or huggingface-cli download with older "
                    "huggingface_hub), then pass DIR")
        raise ConfigError(f"{flag} {path}: no such folder{hint}")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path} is a file; expected a Hugging Face checkpoint folder or a .gguf file")
    if not any(folder.iterdir()):
        raise ConfigError(f"{flag} {path} is empty; expected a Hugging Face checkpoint folder "
                          "(config.json, *.safetensors, tokenizer files)")


def check_tokenizer_dir(path: str, flag: str) -> None:
    if is_gguf(path):  # transformers builds the tokenizer from the file's metadata
        if not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such GGUF file")
        return
    if not Path(path).is_dir():
        raise ConfigError(f"{flag} {path}: no such folder")
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{flag} {path} has no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                          "pass --tokenizer DIR")


def check_device(device: str) -> None:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise ConfigError(f"--device {device}: {why} (torch {torch.__version__}); use --device cpu")
