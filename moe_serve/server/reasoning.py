"""Reasoning models (--reasoning-parser): the <think> section of an answer -> reasoning_content.

Two families, as vLLM names them:
- deepseek_r1: the chat template opens <think> in the prompt, so the answer starts in the
  reasoning (a <think> the model writes itself is dropped) and </think> ends it; an answer that
  never closes it is all reasoning;
- qwen3: the answer reasons only if it starts with <think>; otherwise it is all content (what
  Qwen3 writes with enable_thinking false, its template having closed an empty section).

Text that could still be the beginning of a tag is held back, so a tag never reaches either part.
"""
from __future__ import annotations

from enum import Enum

from moe_serve.server.tool_parsers.base import held_marker_length

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")
# vLLM's name for gpt-oss's analysis channel, which the harmony format reads (moe_serve/server/harmony.py)
HARMONY_REASONING_PARSER = "openai_gptoss"


class Phase(Enum):
    OPENING = "opening"  # not yet known whether (or where) the reasoning starts
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningStream:
    """One choice's text -> (reasoning, content) deltas."""

    def __init__(self, parser: str) -> None:
        self._starts_in_reasoning = parser == "deepseek_r1"
        self._phase = Phase.OPENING
        self._pending = ""  # text not yet given to either part
        self._fed = 0  # characters of text fed so far
        # where the reasoning starts and ends in the text fed (None: no reasoning; not closed, so far)
        self._start: int | None = None
        self._end: int | None = None

    def feed(self, text: str, final: bool) -> tuple[str, str]:
        self._pending += text
        self._fed += len(text)
        reasoning = ""
        if self._phase is Phase.OPENING:
            self._open(final)
        if self._phase is Phase.REASONING:
            reasoning = self._reason(final)
        if self._phase is Phase.CONTENT:
            content, self._pending = self._pending, ""
            return reasoning, content
        return reasoning, ""

    def in_reasoning(self, offset: int) -> bool:
        """Whether the character at offset in the text fed is reasoning (as far as fed, for one not closed)."""
        return self._start is not None and self._start <= offset and (self._end is None or offset < self._end)

    def _open(self, final: bool) -> None:
        head = self._pending.lstrip()
        if head.startswith(START):
            self._pending, self._phase = head[len(START):], Phase.REASONING
        elif START.startswith(head) and not final:
            return  # could still become the tag
        else:
            self._phase = Phase.REASONING if self._starts_in_reasoning else Phase.CONTENT
        if self._phase is Phase.REASONING:
            self._start = self._fed - len(self._pending)

    def _reason(self, final: bool) -> str:
        at = self._pending.find(END)
        if at >= 0:
            self._end = self._fed - len(self._pending) + at
            reasoning, self._pending = self._pending[:at], self._pending[at + len(END):]
            self._phase = Phase.CONTENT
            return reasoning
        cut = len(self._pending) - (0 if final else held_marker_length(self._pending, END))
        reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        return reasoning
