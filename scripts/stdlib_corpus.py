"""The default model's corpus and tokenizer: CPython's standard library source.

Shared by train_default_model.py (which builds both once, on CPU) and
measure_default_model.py (which re-reads the same held-out files).  Every choice here is a
pure function of the file list, so the same Python version gives the same corpus, split and
tokenizer on any machine.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, PAD_TOKEN, IM_START, IM_END]  # ids 0..3, in this order

HELDOUT_PERCENT = 5  # buckets [0, 5): reported figures only
VALIDATION_PERCENT = 3  # buckets [5, 8): early stopping during training
CHAT_PERCENT = 20  # share of training files wrapped as a chat turn, so chat prompts get code back
MAX_FILE_BYTES = 1_000_000  # a handful of generated tables (unicode data, topics) are skipped

# ChatML, as Qwen ships it; the model learned it from the chat-wrapped training files. Tools and
# tool turns render in Qwen2.5's hermes style (<tools> in the system turn, <tool_call> and
# <tool_response> blocks), so the server's hermes parser reads the calls; without them the text
# is byte for byte the ChatML the model was trained on.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first and tools %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for call in message['tool_calls'] %}"
    "{%- set function = call['function'] %}"
    "{%- set arguments = function['arguments'] if function['arguments'] is string"
    " else function['arguments'] | tojson %}"
    "{{- ('\n' if message['content'] or not loop.first else '') + '<tool_call>\n{\"name\": '"
    " + (function['name'] | tojson) + ', \"arguments\": ' + arguments + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\n<tool_response>\n' + message['content'] + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class Document:
    relpath: str  # POSIX path relative to the stdlib root: the key of every split decision
    text: str


def _bucket(relpath: str, salt: str) -> int:
    """A stable 0..99 bucket per file; Python's hash() is salted per process, sha256 is not."""
    digest = hashlib.sha256(f"{salt}:{relpath}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100


def split_of(relpath: str) -> str:
    bucket = _bucket(relpath, "heldout")
    if bucket < HELDOUT_PERCENT:
        return "heldout"
    return "validation" if bucket < HELDOUT_PERCENT + VALIDATION_PERCENT else "train"


def is_chat_wrapped(relpath: str) -> bool:
    return _bucket(relpath, "chat") < CHAT_PERCENT


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def collect_stdlib(root: Path) -> list[Document]:
    """Every UTF-8 `.py` file under root except site-packages, sorted by path."""
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith("site-packages/") or path.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately mis-encoded
        if text.strip():
            docs.append(Document(rel, text))
    return docs


def write_corpus(docs: list[Document], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"path": doc.relpath, "text": doc.text}) + "\n")


def read_corpus(path: Path) -> list[Document]:
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [Document(row["path"], row["text"]) for row in map(json.loads, f)]


def split(docs: list[Document], name: str) -> list[Document]:
    """The files of one split, "train", "validation" or "heldout", in corpus order."""
    return [d for d in docs if split_of(d.relpath) == name]


def module_name(relpath: str) -> str:
    return relpath.removesuffix(".py").removesuffix("/__init__").replace("/", ".")


def training_text(doc: Document) -> str:
    """The text a training file contributes; the end-of-text token is appended by the caller."""
    if not is_chat_wrapped(doc.relpath):
        return doc.text
    prompt = f"Write the Python module `{module_name(doc.relpath)}`."
    return f"{IM_START}user\n{prompt}{IM_END}\n{IM_START}assistant\n{doc.text}{IM_END}\n"


def train_tokenizer(docs: list[Document], vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style, so any byte string round-trips) trained on docs."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((d.text for d in docs), trainer=trainer, length=len(docs))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
