"""langchain-openai's ChatOpenAI against the real server: invoke and stream, bind_tools (auto, forced,
streamed), with_structured_output with every method, and a two-turn tool agent, on chat completions
and (use_responses_api) on /v1/responses."""
from __future__ import annotations

import json
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.server.clients.conftest import Point


@tool
def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


ASK_WEATHER = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def llm(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url, api_key="unused", model="default", temperature=0, max_tokens=16,
                      max_retries=0)


def test_invoke_and_stream_give_the_same_text(llm: ChatOpenAI) -> None:
    answer = llm.invoke("def add(a, b):")
    assert isinstance(answer, AIMessage) and answer.content
    assert answer.response_metadata["finish_reason"] == "length"
    assert answer.response_metadata["model_name"] == "default"
    assert answer.usage_metadata["output_tokens"] == 16
    chunks = list(llm.stream("def add(a, b):"))
    assert len(chunks) > 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert "".join(c.content for c in chunks) == answer.content


def test_bind_tools_auto_answers_in_the_protocol_shape(llm: ChatOpenAI) -> None:
    answer = llm.bind_tools([get_weather]).invoke(ASK_WEATHER)
    # the code model chooses for itself under "auto": whatever it chose must be well formed
    assert not answer.invalid_tool_calls or answer.response_metadata["finish_reason"] == "length"
    assert all(call["name"] == "get_weather" for call in answer.tool_calls)
    assert answer.content or answer.tool_calls


@pytest.mark.parametrize("tool_choice", ["get_weather", "any"])
def test_bind_tools_forced_calls_the_tool(llm: ChatOpenAI, tool_choice: str) -> None:
    answer = llm.bind_tools([get_weather], tool_choice=tool_choice, strict=True, max_tokens=48).invoke(ASK_WEATHER)
    [call] = answer.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Tokyo")
    assert call["id"].startswith("call_") and not answer.invalid_tool_calls
    assert answer.response_metadata["finish_reason"] == "tool_calls"


def test_streamed_tool_call_adds_up_to_the_non_streamed_one(llm: ChatOpenAI) -> None:
    bound = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True, max_tokens=48)
    whole = bound.invoke(ASK_WEATHER)
    merged = None
    for chunk in bound.stream(ASK_WEATHER):
        assert "<tool_call>" not in chunk.content
        merged = chunk if merged is None else merged + chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [(c["name"], c["args"]) for c in whole.tool_calls]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_with_structured_output_returns_the_pydantic_object(llm: ChatOpenAI, method: str) -> None:
    structured = llm.bind(max_tokens=48).with_structured_output(Point, method=method, include_raw=True)
    result = structured.invoke("Give a point.")
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Point)


def test_with_structured_output_json_mode_returns_the_pydantic_object(llm: ChatOpenAI) -> None:
    # json_mode asks only for "some JSON object": the shape comes from the conversation, here one example
    structured = llm.bind(max_tokens=48).with_structured_output(Point, method="json_mode", include_raw=True)
    result = structured.invoke([("user", "A point."), ("assistant", '{"x": 1, "y": 2}'), ("user", "A point.")])
    assert result["parsing_error"] is None
    assert isinstance(result["parsed"], Point)
    assert json.loads(result["raw"].content) == result["parsed"].model_dump()


@pytest.fixture(scope="module")
def responses_llm(base_url: str) -> ChatOpenAI:
    """ChatOpenAI on POST /v1/responses instead of chat completions."""
    return ChatOpenAI(base_url=base_url, api_key="unused", model="default", temperature=0, max_tokens=16,
                      max_retries=0, use_responses_api=True)


def test_responses_api_invoke_stream_and_structured_output(responses_llm: ChatOpenAI) -> None:
    answer = responses_llm.invoke("def add(a, b):")
    assert answer.response_metadata["id"].startswith("resp_") and answer.text
    assert answer.response_metadata["incomplete_details"] == {"reason": "max_output_tokens"}
    merged = None
    for chunk in responses_llm.stream("def add(a, b):"):
        merged = chunk if merged is None else merged + chunk
    assert merged.text == answer.text
    point = responses_llm.bind(max_tokens=48).with_structured_output(Point, method="json_schema").invoke("Give a point.")
    assert isinstance(point, Point)


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_two_turn_tool_agent(llm: ChatOpenAI, responses_llm: ChatOpenAI, api: str) -> None:
    llm = llm if api == "chat" else responses_llm
    messages = [HumanMessage(ASK_WEATHER)]
    first = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True, max_tokens=48).invoke(messages)
    [call] = first.tool_calls
    messages += [first, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    # the second turn sends the assistant's call (chat: a message with tool_calls; responses: a
    # function_call item), then the tool's answer
    second = llm.bind_tools([get_weather]).invoke(messages)
    assert isinstance(second, AIMessage) and (second.content or second.tool_calls)
    assert not second.invalid_tool_calls or second.response_metadata["finish_reason"] == "length"
    # the tool turn reached the template: the second prompt holds the first one, the call and the result
    assert second.usage_metadata["input_tokens"] > first.usage_metadata["input_tokens"] + 10
