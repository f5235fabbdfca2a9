"""MiniMax-M2 tool calls (its chat template's):

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    <parameter name="days">[1, 2]</parameter>
    </invoke>
    </minimax:tool_call>

several invokes in one block, a string value as it is and any other as JSON, typed by the tool's
schema (argument_values.py). The arguments are given as the JSON object of the parameters read so
far, closed with the invoke. Its special tokens are kept: the block's tags are among them.
"""
from __future__ import annotations

from moe_serve.server.tool_parsers.argument_values import close_arguments, json_pair
from moe_serve.server.tool_parsers.base import MarkerParser, call_blocks
from moe_serve.server.tool_parsers.json_scan import PartialCall, skip_whitespace

START = "<minimax:tool_call>"
INVOKE_OPEN, INVOKE_CLOSE = '<invoke name="', "</invoke>"
PARAMETER_OPEN, PARAMETER_CLOSE = '<parameter name="', "</parameter>"
TAG_END = '">'


class MiniMaxM2Parser(MarkerParser):
    start_marker = START
    keeps_special_tokens = True

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        return call_blocks(markup, skip_whitespace(markup, len(START)), INVOKE_OPEN, self._scan_call)

    def _scan_call(self, markup: str, i: int) -> tuple[PartialCall | None, int]:
        """One invoke from after its opening: (the call, or None while its name is unfinished; next index)."""
        name_end = markup.find(TAG_END, i)
        if name_end < 0:
            return None, i
        call = PartialCall(name=markup[i:name_end].strip())
        schema = self.parameters.get(call.name)
        pairs: list[str] = []
        j = skip_whitespace(markup, name_end + len(TAG_END))
        while markup.startswith(PARAMETER_OPEN, j):
            key_end = markup.find(TAG_END, j)
            value_end = markup.find(PARAMETER_CLOSE, key_end) if key_end >= 0 else -1
            if value_end < 0:
                break  # unfinished
            key = markup[j + len(PARAMETER_OPEN):key_end]
            pairs.append(json_pair(key, markup[key_end + len(TAG_END):value_end], schema))
            j = skip_whitespace(markup, value_end + len(PARAMETER_CLOSE))
        return call, close_arguments(call, pairs, markup, j, INVOKE_CLOSE, PARAMETER_OPEN)
