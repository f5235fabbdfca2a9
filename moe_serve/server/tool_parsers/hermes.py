"""Hermes-style tool calls (Qwen2.5, Qwen3, the embedded default model's template):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

one block per call. Text after the last block is dropped, as vLLM's hermes parser does.
"""
from __future__ import annotations

from moe_serve.server.tool_parsers.base import MarkerParser
from moe_serve.server.tool_parsers.json_scan import PartialCall, scan_call_object, skip_whitespace

START, END = "<tool_call>", "</tool_call>"


class HermesParser(MarkerParser):
    start_marker = START

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        calls: list[PartialCall] = []
        i = 0
        while markup.startswith(START, i):
            call = scan_call_object(markup, i + len(START), final)
            calls.append(call)
            if call.end is None or call.broken:
                break
            i = skip_whitespace(markup, call.end)
            if markup.startswith(END, i):
                i = skip_whitespace(markup, i + len(END))
        return calls
