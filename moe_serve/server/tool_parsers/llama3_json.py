"""Llama 3.1/3.2/3.3 JSON tool calls: the whole answer is the call(s), optionally after the
<|python_tag|> special token, several separated by ';':

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

An answer that does not start that way is plain content, as in vLLM's llama3_json parser.
"""
from __future__ import annotations

from moe_serve.server.tool_parsers.base import ToolParser
from moe_serve.server.tool_parsers.json_scan import PartialCall, scan_call_object, skip_whitespace

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    keeps_special_tokens = True

    def content_end(self, text: str, final: bool) -> tuple[int, bool]:
        head = text.lstrip()
        if head.startswith(("{", PYTHON_TAG)):
            return 0, True
        if not final and PYTHON_TAG.startswith(head):  # nothing written yet, or the tag's beginning
            return 0, False
        return len(text), False

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        i = skip_whitespace(markup, 0)
        if markup.startswith(PYTHON_TAG, i):
            i += len(PYTHON_TAG)
        calls: list[PartialCall] = []
        while True:
            call = scan_call_object(markup, i, final)
            calls.append(call)
            if call.end is None or call.broken:
                return calls
            i = skip_whitespace(markup, call.end)
            if not markup.startswith(";", i):
                return calls
            i += 1
