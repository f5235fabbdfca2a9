"""What a tool-call parser tells the stream: where the markup starts, and the calls written so far.

A parser is stateless: it is asked again about the whole text each time the text grows, so a
streamed response and a non-streamed one are read by the same code and cannot disagree.
"""
from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable

from moe_serve.server.tool_parsers.json_scan import PartialCall


class ToolParser(ABC):
    # Decode the model's special tokens too: some families write their tool markup with them.
    keeps_special_tokens = False

    def __init__(self, parameters: dict[str, dict] | None = None) -> None:
        # the request's tools: name -> parameters' JSON schema (for formats that write arguments
        # other than as JSON, whose values take their types from it: glm45)
        self.parameters = parameters or {}

    @abstractmethod
    def content_end(self, text: str, final: bool) -> tuple[int, bool]:
        """(how much of text is plain content for sure, whether tool markup starts right there).

        Text that could still turn out to be the start of the markup is held back."""

    @abstractmethod
    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        """The calls in the markup (text from where it starts), as far as written; where the text
        stops being calls, the last call comes back broken. final: the text is complete."""

    def new_call_id(self) -> str:
        return openai_call_id()


def openai_call_id() -> str:
    """A call id as OpenAI writes them."""
    return f"call_{secrets.token_hex(12)}"


class MarkerParser(ToolParser):
    """Tool markup that begins with a fixed marker, wherever it appears in the output."""

    start_marker: str

    def content_end(self, text: str, final: bool) -> tuple[int, bool]:
        at = text.find(self.start_marker)
        if at >= 0:
            return at, True
        return len(text) - (0 if final else held_marker_length(text, self.start_marker)), False


def call_blocks(markup: str, i: int, begin: str,
                scan_call: Callable[[str, int], tuple[PartialCall | None, int]]) -> list[PartialCall]:
    """The calls of consecutive blocks that each open with `begin`, from markup[i]: scan_call(markup,
    just past begin) gives (the call, or None while its name is unfinished; where the next block may
    begin). Reading stops at an unfinished or broken call."""
    calls: list[PartialCall] = []
    while markup.startswith(begin, i):
        call, i = scan_call(markup, i + len(begin))
        if call is None:
            break
        calls.append(call)
        if call.end is None or call.broken:
            break
    return calls


def could_start(rest: str, mark: str) -> bool:
    """rest is mark's beginning, or starts with mark: the markup may still go on as mark."""
    return mark.startswith(rest) or rest.startswith(mark)


def held_marker_length(text: str, marker: str) -> int:
    """How many characters at the end of text could be the beginning of marker."""
    for held in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-held:]):
            return held
    return 0
