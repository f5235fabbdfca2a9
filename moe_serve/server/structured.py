"""A request's structured output: response_format, vLLM's structured_outputs and guided_* extras
-> one engine StructuredOutput, checked against the served tokenizer before anything is submitted.

Every grammar the engine receives has compiled here once, so a bad schema, regex or grammar is a
400 naming the field that carried it, never an error in the middle of a batch.
"""
from __future__ import annotations

import json
from collections.abc import Iterator

from moe_serve.engine.messages import StructuredOutput
from moe_serve.engine.structured import GrammarError, Grammars
from moe_serve.server.errors import bad_request
from moe_serve.server.protocol import GenerationFields, StructuredOutputsParams


def requested_structured_output(body: GenerationFields) -> tuple[str, StructuredOutput] | None:
    """The one constraint the body asks for and the field that asked (None: plain text). Cheap:
    nothing compiles (checked_structured_output does)."""
    asked = list(_requested(body))
    if len(asked) > 1:
        names = ", ".join(param for param, _ in asked)
        raise bad_request(f"give one structured output, not several ({names})", asked[1][0])
    return asked[0] if asked else None


def checked_structured_output(param: str, structured: StructuredOutput, grammars: Grammars) -> StructuredOutput:
    """`structured`, compiled once against the served tokenizer; a 400 naming `param` if it cannot be."""
    try:
        grammars.check(structured)
    except GrammarError as exc:
        raise bad_request(f"'{param}' cannot be used for constrained decoding: {exc}", param) from None
    return structured


def _requested(body: GenerationFields) -> Iterator[tuple[str, StructuredOutput]]:
    """(the field that asked, its constraint) for every structured output the body carries."""
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        yield "response_format", StructuredOutput("json_object", "")
    elif fmt is not None and fmt.type == "json_schema":
        # no schema: any JSON value, as OpenAI's schema field is optional
        yield "response_format", _json_schema(fmt.json_schema.schema_ or {}, "response_format")
    if body.structured_outputs is not None:
        yield "structured_outputs", _from_structured_outputs(body.structured_outputs)
    if body.guided_json is not None:
        yield "guided_json", _json_schema(body.guided_json, "guided_json")
    if body.guided_regex is not None:
        yield "guided_regex", StructuredOutput("regex", body.guided_regex)
    if body.guided_choice is not None:
        yield "guided_choice", StructuredOutput("choice", json.dumps(body.guided_choice))
    if body.guided_grammar is not None:
        yield "guided_grammar", StructuredOutput("grammar", body.guided_grammar)


def _from_structured_outputs(params: StructuredOutputsParams) -> StructuredOutput:
    given = {name: value for name, value in (("json", params.json_), ("regex", params.regex),
                                             ("choice", params.choice), ("grammar", params.grammar),
                                             ("json_object", params.json_object or None)) if value is not None}
    if len(given) != 1:
        raise bad_request("structured_outputs needs exactly one of json, regex, choice, grammar or json_object "
                          f"(got {len(given) or 'none'})", "structured_outputs")
    [(name, value)] = given.items()
    if name == "json":
        return _json_schema(value, "structured_outputs")
    if name == "json_object":
        return StructuredOutput("json_object", "")
    if name == "choice":
        return StructuredOutput("choice", json.dumps(value))
    return StructuredOutput(name, value)


def _json_schema(schema: dict | str, param: str) -> StructuredOutput:
    """A schema given as an object or as JSON text (vLLM takes both)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise bad_request(f"'{param}': the schema is not valid JSON: {exc}", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}': a JSON schema is an object", param)
    return StructuredOutput("json_schema", json.dumps(schema))
