"""Qwen3-Coder tool calls (its chat template's; Qwen3-Coder-30B-A3B is a Qwen3-MoE):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    [1, 2]
    </parameter>
    </function>
    </tool_call>

one block per call, each value between a newline after its tag and one before the closing tag:
a string as it is, a mapping or list as JSON, anything else as Python prints it, typed by the
tool's schema (argument_values.py). The arguments are given as the JSON object of the parameters
read so far, closed with the function.
"""
from __future__ import annotations

from moe_serve.server.tool_parsers.argument_values import close_arguments, json_pair
from moe_serve.server.tool_parsers.base import MarkerParser, call_blocks, could_start
from moe_serve.server.tool_parsers.json_scan import PartialCall, skip_whitespace

START, END = "<tool_call>", "</tool_call>"
FUNCTION_OPEN, FUNCTION_CLOSE = "<function=", "</function>"
PARAMETER_OPEN, PARAMETER_CLOSE = "<parameter=", "</parameter>"


class Qwen3CoderParser(MarkerParser):
    start_marker = START

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        return call_blocks(markup, 0, START, self._scan_call)

    def _scan_call(self, markup: str, i: int) -> tuple[PartialCall | None, int]:
        """One call from after <tool_call>: (the call, or None while its name is unfinished; next index)."""
        i = skip_whitespace(markup, i)
        if not markup.startswith(FUNCTION_OPEN, i):
            return (None if could_start(markup[i:], FUNCTION_OPEN) else PartialCall(broken=True)), i
        name_end = markup.find(">", i)
        if name_end < 0:
            return None, i
        call = PartialCall(name=markup[i + len(FUNCTION_OPEN):name_end].strip())
        schema = self.parameters.get(call.name)
        pairs: list[str] = []
        j = skip_whitespace(markup, name_end + 1)
        while markup.startswith(PARAMETER_OPEN, j):
            key_end = markup.find(">", j)
            value_end = markup.find(PARAMETER_CLOSE, key_end) if key_end >= 0 else -1
            if value_end < 0:
                break  # unfinished
            value = markup[key_end + 1:value_end]
            value = value.removeprefix("\n").removesuffix("\n")  # the template's own newlines
            pairs.append(json_pair(markup[j + len(PARAMETER_OPEN):key_end].strip(), value, schema))
            j = skip_whitespace(markup, value_end + len(PARAMETER_CLOSE))
        j = close_arguments(call, pairs, markup, j, FUNCTION_CLOSE, PARAMETER_OPEN)
        if call.end is not None and markup.startswith(END, j):  # the block closes after its function
            call.end = j + len(END)
            j = skip_whitespace(markup, call.end)
        return call, j
