"""Incremental scanning of the JSON a model writes for a tool call, before it is complete.

Streaming needs a call's name as soon as it is written and its arguments as raw text, piece by
piece: the arguments are the exact characters the model wrote between the value's first and
last character, so every streamed piece is a prefix of the final string and the pieces add up
to what a non-streamed response returns. json.loads only sees complete values.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

WHITESPACE = " \t\r\n"
_SCALAR_END = ",}]" + WHITESPACE
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Mistral write "arguments", Llama 3 "parameters"


class Malformed(ValueError):
    """The text cannot become the JSON that was expected, however it continues."""


@dataclass
class PartialCall:
    """One tool call as far as it has been written."""

    name: str | None = None
    arguments: str = ""  # raw JSON text so far
    end: int | None = None  # index just past the call's text, once it is complete
    broken: bool = False  # the text went on as something else: nothing after this is a call


def skip_whitespace(text: str, i: int) -> int:
    while i < len(text) and text[i] in WHITESPACE:
        i += 1
    return i


def value_end(text: str, start: int, final: bool) -> int | None:
    """Index just past the JSON value starting at text[start], or None while it is unfinished.

    Only strings and bracket nesting are followed (the content is not validated): enough to know
    which characters belong to the value. final: the text will not grow (a number can end there).
    """
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        return _container_end(text, start)
    if first in "}]:,":
        raise Malformed(f"unexpected {first!r} where a value starts")
    i = start
    while i < len(text) and text[i] not in _SCALAR_END:
        i += 1
    return i if i < len(text) or final else None


def _string_end(text: str, start: int) -> int | None:
    i = start + 1
    while i < len(text):
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return None


def _container_end(text: str, start: int) -> int | None:
    depth, i = 0, start
    while i < len(text):
        c = text[i]
        if c == '"':
            end = _string_end(text, i)
            if end is None:
                return None
            i = end
            continue
        if c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def scan_call_object(text: str, start: int, final: bool) -> PartialCall:
    """A call written as {"name": "...", "arguments": {...}} from text[start] on (other keys skipped).

    A call whose text stops being such an object, or ends without a name, comes back broken with
    what it had so far.
    """
    call = PartialCall()
    try:
        _scan_object(text, start, final, call)
    except ValueError:  # Malformed, or a key json.loads cannot read
        call.broken = True
    return call


def _scan_object(text: str, start: int, final: bool, call: PartialCall) -> None:
    i = skip_whitespace(text, start)
    if i == len(text):
        return
    if text[i] != "{":
        raise Malformed("a tool call must be a JSON object")
    i += 1
    while True:
        i = skip_whitespace(text, i)
        if i == len(text):
            return
        if text[i] == "}":
            if call.name is None:
                raise Malformed("a tool call without a name")
            call.arguments = call.arguments or "{}"
            call.end = i + 1
            return
        if text[i] == ",":
            i += 1
            continue
        i = _scan_field(text, i, final, call)
        if i is None:
            return


def _scan_field(text: str, i: int, final: bool, call: PartialCall) -> int | None:
    """One "key": value pair into call; the index after it, or None while it is unfinished."""
    if text[i] != '"':
        raise Malformed("expected a quoted key")
    key_end = _string_end(text, i)
    if key_end is None:
        return None
    key = json.loads(text[i:key_end])
    i = skip_whitespace(text, key_end)
    if i == len(text):
        return None
    if text[i] != ":":
        raise Malformed(f"expected ':' after {key!r}")
    start = skip_whitespace(text, i + 1)
    end = value_end(text, start, final)
    if key in ARGUMENT_KEYS:
        call.arguments = text[start:len(text) if end is None else end]
    elif key in NAME_KEYS and end is not None:
        name = json.loads(text[start:end])
        if not isinstance(name, str):
            raise Malformed("a tool call's name must be a string")
        call.name = name
    return end


def scan_call_array(text: str, start: int, final: bool) -> list[PartialCall]:
    """Calls written as a JSON array of call objects, from just after its '['."""
    calls: list[PartialCall] = []
    i = start
    while True:
        i = skip_whitespace(text, i)
        if i == len(text) or text[i] == "]":
            return calls
        if text[i] == ",":
            i += 1
            continue
        call = scan_call_object(text, i, final)
        calls.append(call)
        if call.end is None or call.broken:
            return calls
        i = call.end
