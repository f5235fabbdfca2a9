"""Incremental detokenisation: token ids in, text deltas out, never half a UTF-8 character."""
from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Each step re-decodes a short window ids[prefix:] and emits what it adds over ids[prefix:read].
    Decoding in context keeps SentencePiece / byte-level word-initial spaces right, and a window
    that ends in U+FFFD holds a character whose bytes are still arriving, so nothing is emitted
    until a later token completes it (or flush() gives up at the end).
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: context decoded again but already emitted
        self._read = 0  # everything before this index has been emitted

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text, new_text = self._window()
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Whatever is still held back; an unfinished character comes out as U+FFFD."""
        prefix_text, new_text = self._window()
        self._prefix = self._read = len(self._ids)
        return new_text[len(prefix_text):]

    def _window(self) -> tuple[str, str]:
        return self._decode(self._ids[self._prefix:self._read]), self._decode(self._ids[self._prefix:])
