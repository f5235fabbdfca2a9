"""Incremental detokenisation: token ids in, text deltas out, never half a UTF-8 character."""
from __future__ import annotations

from collections.abc import Callable

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    The text of ids[prefix:] is decoded in context and what it adds over ids[prefix:read] is
    emitted: decoding in context keeps SentencePiece / byte-level word-initial spaces right, and a
    window that ends in U+FFFD holds a character whose bytes are still arriving, so nothing is
    emitted until a later token completes it (or flush() gives up at the end). Where the tokenizer
    has a Rust backend (every fast tokenizer), the tokenizers library's DecodeStream does this per
    token in Rust; the Python window here then only serves flush(). A tokenizer without one (remote
    code) decodes the window twice per token through transformers, ~6 us each.
    """

    def __init__(self, decode: Callable[[list[int]], str], backend: RustTokenizer | None = None,
                 skip_special_tokens: bool = True) -> None:
        """decode: the tokenizer's one-shot decode (skip_special_tokens as given here)."""
        self._decode = decode
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens) if backend is not None else None
        self._ids: list[int] = []
        self._prefix = 0  # window start: context decoded again but already emitted
        self._read = 0  # everything before this index has been emitted

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._streamed(token_id) if self._stream is not None else self._windowed()
        if not text:
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text

    def _streamed(self, token_id: int) -> str | None:
        """DecodeStream's delta; None: nothing new yet (a character's first bytes, a skipped special
        token, an id past the tokenizer's vocabulary, as padded embeddings allow)."""
        try:
            return self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - its error for some runs of invalid UTF-8 bytes ("Invalid prefix
            # encountered"): the window, whose marks it kept, goes on from this token
            self._stream = None
            return self._windowed()

    def _windowed(self) -> str | None:
        prefix_text, new_text = self._window()
        complete = len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT)
        return new_text[len(prefix_text):] if complete else None

    def flush(self) -> str:
        """Whatever is still held back; an unfinished character comes out as U+FFFD."""
        prefix_text, new_text = self._window()
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]

    def _window(self) -> tuple[str, str]:
        return self._decode(self._ids[self._prefix:self._read]), self._decode(self._ids[self._prefix:])
