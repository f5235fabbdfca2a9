"""litellm against the real server through its generic OpenAI provider (`openai/<name>` + api_base):
completion plain and streamed, with tools (forced and auto) and with response_format; responses()
against /v1/responses, plain, structured, with a function tool and streamed."""
from __future__ import annotations

import json

import jsonschema
import litellm
import pytest

from tests.server.clients.conftest import WEATHER_PARAMETERS, WEATHER_TOOL, Point

MODEL = "openai/default"
POINT_SCHEMA = Point.model_json_schema()


def complete(base_url: str, content: str, **kwargs):
    return litellm.completion(model=MODEL, api_base=base_url, api_key="unused", temperature=0,
                              messages=[{"role": "user", "content": content}], **kwargs)


def test_completion_plain_and_streamed(base_url: str) -> None:
    whole = complete(base_url, "def add(a, b):", max_tokens=8)
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 8
    chunks = list(complete(base_url, "def add(a, b):", max_tokens=8, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_completion_with_forced_tools(base_url: str, tool_choice) -> None:
    choice = complete(base_url, "What is the weather in Paris?", tools=[WEATHER_TOOL], tool_choice=tool_choice,
                      max_tokens=32).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMETERS)


def test_completion_with_tools_auto_answers_in_the_protocol_shape(base_url: str) -> None:
    choice = complete(base_url, "What is the weather in Paris?", tools=[WEATHER_TOOL], max_tokens=16).choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    for call in choice.message.tool_calls or ():
        assert call.function.name == "get_weather"


@pytest.mark.parametrize("response_format", [
    Point,
    {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT_SCHEMA, "strict": True}}],
    ids=["pydantic", "json_schema"])
def test_completion_with_response_format(base_url: str, response_format) -> None:
    choice = complete(base_url, "Give a point.", response_format=response_format, max_tokens=48).choices[0]
    assert choice.finish_reason == "stop"
    Point.model_validate_json(choice.message.content)


def respond(base_url: str, **kwargs):
    return litellm.responses(model=MODEL, api_base=base_url, api_key="unused", temperature=0, **kwargs)


def test_responses_plain_and_structured(base_url: str, client_server) -> None:
    plain = respond(base_url, input="def add(a, b):", max_output_tokens=16)
    assert plain.status == "incomplete" and plain.usage.output_tokens == 16
    assert plain.output[0].content[0].text
    structured = respond(base_url, input="Give a point.", max_output_tokens=48,
                         text={"format": {"type": "json_schema", "name": "point", "schema": POINT_SCHEMA, "strict": True}})
    assert structured.status == "completed"
    Point.model_validate_json(structured.output[0].content[0].text)
    assert "POST /v1/responses" in client_server.log()  # served by the Responses endpoint, not bridged to chat


def test_responses_with_a_function_tool(base_url: str) -> None:
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    answer = respond(base_url, input="What is the weather in Paris?", tools=[tool], tool_choice="required",
                     max_output_tokens=32)
    [call] = [item for item in answer.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_responses_streamed(base_url: str) -> None:
    # litellm streams a model it has no entry for by asking once without streaming and replaying the
    # answer as events (with OpenAI's minimum of 16 output tokens): the deltas must add up to it
    events = list(respond(base_url, input="def add(a, b):", max_output_tokens=16, stream=True))
    final = events[-1].response
    assert final.status == "incomplete" and final.usage.output_tokens == 16
    deltas = [e.delta for e in events if str(getattr(e.type, "value", e.type)) == "response.output_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == final.output[0].content[0].text
