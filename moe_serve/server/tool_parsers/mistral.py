"""Mistral's tool calls, after its [TOOL_CALLS] special token, in either of its tokenizers' forms:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]     (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]...                  (v11 and later)

Call ids are nine letters and digits: Mistral's chat templates refuse any other id when the
conversation comes back with the tool results.
"""
from __future__ import annotations

import secrets
import string

from moe_serve.server.tool_parsers.base import MarkerParser
from moe_serve.server.tool_parsers.json_scan import (
    PartialCall,
    scan_call_array,
    skip_whitespace,
    value_end,
)

START, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_ALPHABET = string.ascii_letters + string.digits


class MistralParser(MarkerParser):
    start_marker = START
    keeps_special_tokens = True

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        i = skip_whitespace(markup, len(START))
        if markup.startswith("[", i):
            return scan_call_array(markup, i + 1, final)
        return _scan_named_blocks(markup, final)

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _scan_named_blocks(markup: str, final: bool) -> list[PartialCall]:
    calls: list[PartialCall] = []
    i = 0
    while markup.startswith(START, i):
        args_at = markup.find(ARGS, i)
        if args_at < 0:
            break  # the name is still being written
        call = PartialCall(name=markup[i + len(START):args_at].strip())
        calls.append(call)
        start = skip_whitespace(markup, args_at + len(ARGS))
        try:
            end = value_end(markup, start, final)
        except ValueError:
            call.broken = True
            break
        call.arguments = markup[start:len(markup) if end is None else end]
        if end is None:
            break
        call.end = end
        i = skip_whitespace(markup, end)
    return calls
