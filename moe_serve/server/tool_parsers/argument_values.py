"""Argument values that a tool-call format writes as text, not JSON (GLM-4.5's <arg_value>,
Qwen3-Coder's <parameter=...>): a string bare, anything else as its template prints it. The tool's
parameter schema says which a value is, as vLLM's parsers read it: a string where the schema says
string (or enumerates strings); a boolean or null also in Python's spelling (Qwen3-Coder's template
prints them with `| string`: True, None); anything else read as JSON, and kept as a string where it
is not JSON. Without a schema, what reads as JSON is JSON."""
from __future__ import annotations

import json
from typing import Any

from moe_serve.server.tool_parsers.base import could_start
from moe_serve.server.tool_parsers.json_scan import PartialCall, skip_whitespace

_PYTHON_LITERALS = {"True": "true", "False": "false", "None": "null"}


def property_schema(parameters: dict[str, Any] | None, key: str) -> dict[str, Any]:
    """The schema of one argument in a tool's parameters schema ({} where it has none)."""
    properties = (parameters or {}).get("properties")
    found = properties.get(key) if isinstance(properties, dict) else None
    return found if isinstance(found, dict) else {}


def json_pair(key: str, value: str, parameters: dict[str, Any] | None) -> str:
    """'"key": value' of one argument written as text, for a tool whose parameters schema is `parameters`."""
    return f"{json.dumps(key, ensure_ascii=False)}: {argument_json(value, property_schema(parameters, key))}"


def close_arguments(call: PartialCall, pairs: list[str], markup: str, j: int, close: str, more: str) -> int:
    """Give call its arguments, the JSON object of `pairs` (its "key": value texts), closed where
    markup at j closes the call with `close`, left open while it may still go on with `more` (the
    next pair) or `close`, the call broken otherwise. Where the call's markup continues: past
    `close` and whitespace, or j."""
    call.arguments = "{" + ", ".join(pairs)
    if not call.broken and markup.startswith(close, j):
        call.arguments += "}"
        call.end = j + len(close)
        return skip_whitespace(markup, call.end)
    rest = markup[j:]
    call.broken = call.broken or not (could_start(rest, more) or could_start(rest, close))
    return j


def argument_json(value: str, schema: dict[str, Any]) -> str:
    """The JSON text of one argument written as text."""
    kind, enum = schema.get("type"), schema.get("enum")
    if kind == "string" or (isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum)):
        return json.dumps(value, ensure_ascii=False)
    text = value.strip()
    if kind in ("boolean", "null") and text in _PYTHON_LITERALS:
        return _PYTHON_LITERALS[text]
    try:
        parsed = json.loads(text)
    except ValueError:
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value, ensure_ascii=False) if isinstance(parsed, str) else text
