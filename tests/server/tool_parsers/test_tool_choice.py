"""tool_choice -> prompt tools, constraint and parser; the forced calls' JSON schemas."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from transformers import AutoTokenizer

from moe_serve.engine.messages import StructuredOutput
from moe_serve.engine.structured import Grammars
from moe_serve.server.errors import APIError
from moe_serve.server.protocol import ChatCompletionRequest
from moe_serve.server.tool_parsers.forced import NamedParser, RequiredParser, required_schema
from moe_serve.server.tool_parsers.hermes import HermesParser
from moe_serve.server.tool_parsers.tool_choice import tool_calling

DEFAULT_MODEL = Path(__file__).resolve().parents[3] / "moe_serve" / "models" / "default"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(lambda: AutoTokenizer.from_pretrained(DEFAULT_MODEL))


def body(**fields) -> ChatCompletionRequest:
    request = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    **fields})
    request.check()
    return request


def test_required_schema_binds_each_name_to_its_parameters() -> None:
    schema = required_schema({"get_weather": WEATHER, "now": None}, parallel=True)
    validate = jsonschema.Draft202012Validator(schema).is_valid
    assert validate([{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "now", "parameters": {}}])
    assert not validate([])
    assert not validate([{"name": "now", "parameters": {"city": "Paris"}, "extra": 1}])
    assert not validate([{"name": "get_weather", "parameters": {}}])  # city is required
    assert not validate([{"name": "other", "parameters": {}}])
    single = jsonschema.Draft202012Validator(required_schema({"now": None}, parallel=False)).is_valid
    assert single([{"name": "now", "parameters": {}}]) and not single([{"name": "now", "parameters": {}}] * 2)


def test_none_and_no_tools_call_nothing(grammars: Grammars) -> None:
    assert tool_calling(body(), "hermes", grammars) is None
    assert tool_calling(body(tools=TOOLS, tool_choice="none"), "hermes", grammars) is None


def test_auto_is_the_default_with_tools_and_needs_a_parser(grammars: Grammars) -> None:
    calling = tool_calling(body(tools=TOOLS), "hermes", grammars)
    assert isinstance(calling.parser, HermesParser) and calling.structured is None
    assert calling.template_tools == TOOLS and calling.max_calls is None
    with pytest.raises(APIError) as err:
        tool_calling(body(tools=TOOLS), None, grammars)
    assert err.value.param == "tool_choice" and "--tool-call-parser" in err.value.message


def test_required_and_named_are_constrained_json(grammars: Grammars) -> None:
    required = tool_calling(body(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None, grammars)
    assert isinstance(required.parser, RequiredParser) and required.max_calls == 1
    assert json.loads(required.structured.spec) == required_schema({"get_weather": WEATHER, "now": None}, False)
    named = tool_calling(body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                         None, grammars)
    assert isinstance(named.parser, NamedParser) and named.parser.name == "get_weather"
    assert named.structured == StructuredOutput("json_schema", json.dumps(WEATHER))


def test_a_forced_call_cannot_be_combined_with_another_constraint(grammars: Grammars) -> None:
    required = tool_calling(body(tools=TOOLS, tool_choice="required"), None, grammars)
    with pytest.raises(APIError) as err:
        required.constrain(StructuredOutput("json_object", ""))
    assert err.value.param == "tool_choice"
    auto = tool_calling(body(tools=TOOLS), "hermes", grammars)
    assert auto.constrain(StructuredOutput("json_object", "")) == StructuredOutput("json_object", "")


def test_a_schema_the_grammar_engine_cannot_compile_is_a_400_naming_tools(grammars: Grammars) -> None:
    unresolvable = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": unresolvable}}]
    with pytest.raises(APIError) as err:
        tool_calling(body(tools=tools, tool_choice="required"), None, grammars)
    assert err.value.status == 400 and err.value.param == "tools"
