"""DeepSeek-V3 / R1 tool calls, written with their special tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>
"""
from __future__ import annotations

from moe_serve.server.tool_parsers.base import MarkerParser, call_blocks
from moe_serve.server.tool_parsers.json_scan import PartialCall, skip_whitespace, value_end

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
SEP = "<｜tool▁sep｜>"
CALL_END = "<｜tool▁call▁end｜>"
FENCE_OPEN, FENCE_CLOSE = "```json", "```"


class DeepSeekV3Parser(MarkerParser):
    start_marker = CALLS_BEGIN
    keeps_special_tokens = True

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        return call_blocks(markup, skip_whitespace(markup, len(CALLS_BEGIN)), CALL_BEGIN,
                           lambda text, i: _scan_call(text, i, final))


def _scan_call(markup: str, i: int, final: bool) -> tuple[PartialCall | None, int]:
    """One call from after its begin token: (the call, or None while its name is unfinished; next index)."""
    sep = markup.find(SEP, i)
    name_end = markup.find("\n", sep + len(SEP)) if sep >= 0 else -1
    if name_end < 0:
        return None, i
    call = PartialCall(name=markup[sep + len(SEP):name_end].strip())
    start = skip_whitespace(markup, name_end)
    if not markup.startswith(FENCE_OPEN, start):
        call.broken = not FENCE_OPEN.startswith(markup[start:])
        return call, start
    start = skip_whitespace(markup, start + len(FENCE_OPEN))
    try:
        end = value_end(markup, start, final)
    except ValueError:
        call.broken = True
        return call, start
    call.arguments = markup[start:len(markup) if end is None else end]
    if end is None:
        return call, len(markup)
    call.end = end
    i = skip_whitespace(markup, end)
    for closing in (FENCE_CLOSE, CALL_END):
        if markup.startswith(closing, i):
            i = skip_whitespace(markup, i + len(closing))
    return call, i
