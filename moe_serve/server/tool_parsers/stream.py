"""One choice's generated text -> content and tool-call deltas, streamed or not.

The text is fed as it is decoded. Content before the tool markup passes through (minus what
could still be the markup's beginning); the markup itself never reaches the content. Each call
is announced once its name is known (index, id, name) and its arguments follow in pieces that
add up to the raw JSON the model wrote. If no call can be read from the markup by the end, the
markup was only text after all and is returned as content.
"""
from __future__ import annotations

from dataclasses import dataclass

from moe_serve.server.tool_parsers.base import ToolParser


@dataclass
class ToolCallDelta:
    index: int
    id: str | None = None  # set on a call's first delta, with its name
    name: str | None = None
    arguments: str = ""


class ToolCallStream:
    """One choice's reader. Each feed re-scans the markup so far (stateless parsers): about 0.3 ms
    a token on a 5 KB call, fed 4 characters at a time on this CPU."""

    def __init__(self, parser: ToolParser, max_calls: int | None) -> None:
        self._parser, self._max_calls = parser, max_calls
        self._text = ""
        self._content_sent = 0
        self._markup_at: int | None = None  # where the tool markup starts in _text
        self._arguments_sent: list[str] = []  # per announced call

    @property
    def keeps_special_tokens(self) -> bool:
        return self._parser.keeps_special_tokens

    @property
    def called(self) -> bool:
        return bool(self._arguments_sent)

    def feed(self, text: str, final: bool) -> tuple[str, list[ToolCallDelta]]:
        """(content, call deltas) that text adds; final: it is the last of the choice's text."""
        self._text += text
        content = self._content(final)
        if self._markup_at is None:
            return content, []
        deltas = self._call_deltas(final)
        if final and not self.called:
            content += self._text[self._markup_at:]
        return content, deltas

    def _content(self, final: bool) -> str:
        if self._markup_at is not None:
            return ""
        end, markup_starts = self._parser.content_end(self._text, final)
        if markup_starts:
            self._markup_at = end
        content, self._content_sent = self._text[self._content_sent:end], max(end, self._content_sent)
        return content

    def _call_deltas(self, final: bool) -> list[ToolCallDelta]:
        calls = self._parser.scan(self._text[self._markup_at:], final)[:self._max_calls]
        deltas = []
        for index, call in enumerate(calls):
            if call.name is None:
                break  # calls are announced in order
            if index == len(self._arguments_sent):
                deltas.append(ToolCallDelta(index, self._parser.new_call_id(), call.name, call.arguments))
                self._arguments_sent.append(call.arguments)
                continue
            sent = self._arguments_sent[index]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                deltas.append(ToolCallDelta(index, arguments=call.arguments[len(sent):]))
                self._arguments_sent[index] = call.arguments
        return deltas


def merge_tool_call_deltas(calls: list[ToolCallDelta], deltas: list[ToolCallDelta]) -> None:
    """Fold a response's deltas into whole calls, as a client reading the stream would."""
    for delta in deltas:
        if delta.index == len(calls):
            calls.append(ToolCallDelta(delta.index, delta.id, delta.name, delta.arguments))
        else:
            calls[delta.index].arguments += delta.arguments
