"""Tool calling through the OpenAI SDK against the real server on the embedded default model (CPU).

The default model is a small code model: whether it chooses a tool under "auto" is up to it, so
"auto" is checked for the protocol's shape, and each --tool-call-parser is driven end to end by
constraining the model's text to its family's markup (the structured_outputs regex extra) while
tool_choice stays "auto": the calls then come out of the parser, not out of the constraint.
"""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import DEFAULT_MODEL, REPO, RunningServer, free_port, start_server

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "unit": {"enum": ["celsius", "fahrenheit"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                           "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
ARGUMENTS = r'\{"city": "(Paris|Tokyo)", "unit": "celsius"\}'
HERMES_CALL = r'<tool_call>\n\{"name": "get_weather", "arguments": ' + ARGUMENTS + r'\}\n</tool_call>'
# each family's markup for one get_weather call, as a regex over the text (the default model's
# tokenizer writes the special tokens of other families as plain text, byte by byte)
FAMILY_CALLS = {
    "mistral": r'\[TOOL_CALLS\]\[\{"name": "get_weather", "arguments": ' + ARGUMENTS + r'\}\]',
    "llama3_json": r'\{"name": "get_weather", "parameters": ' + ARGUMENTS + r'\}',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                   + ARGUMENTS + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "glm45": (r"<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>(Paris|Tokyo)</arg_value>\n"
              r"<arg_key>unit</arg_key>\n<arg_value>celsius</arg_value>\n</tool_call>"),
    "minimax_m2": (r'<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">(Paris|Tokyo)'
                   r'</parameter>\n<parameter name="unit">celsius</parameter>\n</invoke>\n</minimax:tool_call>'),
    "qwen3_coder": (r"<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Tokyo)\n</parameter>\n"
                    r"<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>"),
}


@pytest.fixture(scope="module")
def client(hermes_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=hermes_server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kwargs):
    return client.chat.completions.create(model="default", messages=kwargs.pop("messages", ASK), tools=TOOLS,
                                          seed=kwargs.pop("seed", 1), **kwargs)


def streamed(client: openai.OpenAI, **kwargs) -> tuple[str, list[dict], str | None, list]:
    """(content, calls reassembled from delta.tool_calls, finish_reason, chunks) of a streamed chat."""
    chunks = list(chat(client, stream=True, **kwargs))
    content, calls = "", []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.index == len(calls):
                assert piece.id and piece.type == "function" and piece.function.name
                calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return content, calls, chunks[-1].choices[0].finish_reason, chunks


def calls_of(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]


def assert_valid_calls(calls: list[dict], id_pattern: str = r"call_[0-9a-f]{24}") -> None:
    for call in calls:
        assert re.fullmatch(id_pattern, call["id"]), call["id"]
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_answers_in_the_protocol_shape(client: openai.OpenAI) -> None:
    choice = chat(client, max_tokens=24).choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason in ("tool_calls", "length")
        assert all(c.type == "function" and c.id.startswith("call_") for c in choice.message.tool_calls)
    else:
        assert choice.finish_reason in ("stop", "length") and isinstance(choice.message.content, str)
    assert "<tool_call>" not in (choice.message.content or "")


def assert_auto_reads_calls_out_of(client: openai.OpenAI, markup: str, id_pattern: str = r"call_[0-9a-f]{24}") -> None:
    """The model's text forced to `markup` under tool_choice "auto": one get_weather call, streamed
    or not, and none of the markup as content."""
    forced_text = {"structured_outputs": {"regex": markup}}
    choice = chat(client, max_tokens=160, extra_body=forced_text).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = calls_of(choice.message)
    assert call["name"] == "get_weather"
    assert_valid_calls([call], id_pattern)
    content, calls, finish, _ = streamed(client, max_tokens=160, extra_body=forced_text)
    assert content == "" and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(call["name"], call["arguments"])]


def test_auto_reads_hermes_calls_out_of_the_text(client: openai.OpenAI) -> None:
    assert_auto_reads_calls_out_of(client, HERMES_CALL)


@pytest.fixture(scope="module")
def family_clients(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, openai.OpenAI]]:
    """A client per family's parser, each to an app of its own --tool-call-parser: the apps run in one
    process on one engine (tests/server/parser_servers.py), one server start-up instead of one a parser."""
    first, *others = sorted(FAMILY_CALLS)
    ports = {parser: free_port() for parser in others}
    running = start_server(DEFAULT_MODEL, tmp_path_factory.mktemp("logs"), "--max-model-len", "1024",
                           "--tool-call-parser", first, *(f"--also-serve={p}={port}" for p, port in ports.items()),
                           module="tests.server.parser_servers")
    urls = {first: running.base_url} | {parser: f"http://127.0.0.1:{port}" for parser, port in ports.items()}
    for url in urls.values():
        dataclasses.replace(running, base_url=url).wait_healthy()
    yield {parser: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) for parser, url in urls.items()}
    assert running.stop() == 0


@pytest.mark.parametrize("parser", sorted(FAMILY_CALLS))
def test_each_parser_reads_its_familys_calls_out_of_the_text(family_clients: dict[str, openai.OpenAI],
                                                             parser: str) -> None:
    # Mistral's chat templates refuse call ids other than nine letters and digits
    id_pattern = r"[A-Za-z0-9]{9}" if parser == "mistral" else r"call_[0-9a-f]{24}"
    assert_auto_reads_calls_out_of(family_clients[parser], FAMILY_CALLS[parser], id_pattern)


def test_required_calls_a_tool_on_any_model(client: openai.OpenAI) -> None:
    choice = chat(client, tool_choice="required", parallel_tool_calls=False, max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    assert_valid_calls(calls_of(choice.message))


def test_a_named_function_is_called_with_valid_arguments(client: openai.OpenAI) -> None:
    choice = chat(client, tool_choice=GET_WEATHER, max_tokens=60).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = calls_of(choice.message)
    assert call["name"] == "get_weather"
    assert_valid_calls([call])


@pytest.mark.parametrize("tool_choice", ["required", GET_WEATHER])
def test_streamed_tool_calls_equal_the_non_streamed_ones(client: openai.OpenAI, tool_choice) -> None:
    whole = chat(client, tool_choice=tool_choice, max_tokens=60, seed=5).choices[0]
    content, calls, finish, chunks = streamed(client, tool_choice=tool_choice, max_tokens=60, seed=5)
    assert content == "" and finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [(c["name"], c["arguments"]) for c in calls_of(whole.message)]
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2  # the arguments came in pieces


def test_each_choice_reads_its_own_calls(client: openai.OpenAI) -> None:
    choices = chat(client, tool_choice="required", parallel_tool_calls=False, n=2, max_tokens=60).choices
    singles = [chat(client, tool_choice="required", parallel_tool_calls=False, max_tokens=60, seed=1 + i).choices[0]
               for i in range(2)]
    assert [calls_of(c.message)[0]["arguments"] for c in choices] == \
           [calls_of(c.message)[0]["arguments"] for c in singles]
    assert len({c.message.tool_calls[0].id for c in choices + singles}) == 4


def test_a_two_turn_agent_conversation_is_accepted(client: openai.OpenAI) -> None:
    first = chat(client, tool_choice=GET_WEATHER, max_tokens=60).choices[0].message
    history = ASK + [first,  # the SDK's message object sent back as is, as agent loops do
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "name": "get_weather",
                      "content": '{"temperature": 21}'}]
    answer = chat(client, messages=history, tool_choice="none", max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.tool_calls is None
    call = first.tool_calls[0].function
    rendered = AutoTokenizer.from_pretrained(REPO / "moe_serve" / "models" / "default").apply_chat_template(
        ASK + [{"role": "assistant", "content": None, "tool_calls": [
                   {"type": "function", "function": {"name": call.name, "arguments": json.loads(call.arguments)}}]},
               {"role": "tool", "content": '{"temperature": 21}'}], tokenize=False, add_generation_prompt=True)
    assert f'"arguments": {json.dumps(json.loads(call.arguments))}' in rendered and "<tool_response>" in rendered
    assert answer.usage.prompt_tokens == len(AutoTokenizer.from_pretrained(REPO / "moe_serve" / "models" / "default")(
        rendered, add_special_tokens=False).input_ids)  # the history reached the template, tools not rendered
    again = chat(client, messages=history, max_tokens=8).choices[0]  # auto, the history rendered by the template
    assert again.finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$schema": 5}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/gone"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [], "tool_choice": "auto"}, "tools"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0.tool_calls"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_invalid_tool_requests_are_400s_naming_the_field(client: openai.OpenAI, fields: dict, param: str) -> None:
    kwargs = {"tools": TOOLS, "messages": ASK, **fields}
    if kwargs["tools"] is None:
        del kwargs["tools"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="default", max_tokens=4, **kwargs)
    assert err.value.body["param"] == param
    assert set(err.value.body) == {"message", "type", "param", "code"}

