"""GLM-4.5 tool calls (its chat template's):

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>[1, 2]</arg_value>
    </tool_call>

one block per call, a string argument written as it is and any other as JSON (the template's
`tojson`), typed by the tool's schema (argument_values.py). The arguments are given as the JSON
object of the pairs read so far, each pair added once its value is closed and the object closed
with the call, so every read extends the last.
"""
from __future__ import annotations

from moe_serve.server.tool_parsers.argument_values import close_arguments, json_pair
from moe_serve.server.tool_parsers.base import MarkerParser, call_blocks, could_start
from moe_serve.server.tool_parsers.json_scan import PartialCall, skip_whitespace

START, END = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE = "<arg_key>", "</arg_key>"
VALUE_OPEN, VALUE_CLOSE = "<arg_value>", "</arg_value>"


class Glm45Parser(MarkerParser):
    start_marker = START

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        return call_blocks(markup, 0, START, self._scan_call)

    def _scan_call(self, markup: str, i: int) -> tuple[PartialCall | None, int]:
        """One call from after <tool_call>: (the call, or None while its name is unfinished; next index)."""
        ends = [at for at in (markup.find(mark, i) for mark in ("\n", KEY_OPEN, END)) if at >= 0]
        if not ends:
            return None, i
        call = PartialCall(name=markup[i:min(ends)].strip())
        schema = self.parameters.get(call.name)
        pairs: list[str] = []
        j = skip_whitespace(markup, min(ends))
        while markup.startswith(KEY_OPEN, j):
            key_end = markup.find(KEY_CLOSE, j)
            value_at = skip_whitespace(markup, key_end + len(KEY_CLOSE)) if key_end >= 0 else -1
            value_end = markup.find(VALUE_CLOSE, value_at) if value_at >= 0 else -1
            if value_end < 0:  # unfinished, unless the value does not open where it must
                call.broken = value_at >= 0 and not could_start(markup[value_at:], VALUE_OPEN)
                break
            if not markup.startswith(VALUE_OPEN, value_at):
                call.broken = True
                break
            key = markup[j + len(KEY_OPEN):key_end]
            value = markup[value_at + len(VALUE_OPEN):value_end]
            pairs.append(json_pair(key, value, schema))
            j = skip_whitespace(markup, value_end + len(VALUE_CLOSE))
        return call, close_arguments(call, pairs, markup, j, END, KEY_OPEN)

