"""tool_choice "required" and a named function: the output is constrained to JSON, read as calls.

As vLLM does, the constraint is a JSON schema over the functions' own parameter schemas, so it
works on any model, whatever its chat template knows of tools:
- "required": an array of {"name": <one of the functions>, "parameters": <its arguments>}
  (exactly one item unless parallel_tool_calls);
- a named function: that function's arguments object itself.
"""
from __future__ import annotations

from moe_serve.server.tool_parsers.base import ToolParser
from moe_serve.server.tool_parsers.json_scan import (
    PartialCall,
    scan_call_array,
    skip_whitespace,
    value_end,
)

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def required_schema(parameters_by_name: dict[str, dict | None], parallel: bool) -> dict:
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": parameters or EMPTY_PARAMETERS},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in parameters_by_name.items()]
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(parameters: dict | None) -> dict:
    return parameters or EMPTY_PARAMETERS


class RequiredParser(ToolParser):
    """The whole output is the JSON array of calls."""

    def content_end(self, text: str, final: bool) -> tuple[int, bool]:
        return 0, True

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        i = skip_whitespace(markup, 0)
        return scan_call_array(markup, i + 1, final) if markup.startswith("[", i) else []


class NamedParser(ToolParser):
    """The whole output is the arguments of the one function named."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def content_end(self, text: str, final: bool) -> tuple[int, bool]:
        return 0, True

    def scan(self, markup: str, final: bool) -> list[PartialCall]:
        start = skip_whitespace(markup, 0)
        try:
            end = value_end(markup, start, final)
        except ValueError:
            return [PartialCall(self.name, broken=True)]
        return [PartialCall(self.name, markup[start:len(markup) if end is None else end], end)]
