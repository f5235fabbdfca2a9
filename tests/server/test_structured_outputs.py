"""Structured outputs through the OpenAI SDK against the real server (CPU, tiny random model):
response_format json_schema (client.chat.completions.parse with a pydantic model), json_object and
text, vLLM's structured_outputs and guided_* extras on both endpoints, streamed and not; every
answer parses and validates, and what cannot compile is a 400 naming the field that carried it."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from tests.server.conftest import RunningServer

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    age: int
    mood: Literal["happy", "sad"]
    likes_tea: bool


def chat(client: openai.OpenAI, server: RunningServer, **kwargs):
    return client.chat.completions.create(model=server.model, messages=MESSAGES, **kwargs)


def streamed_chat(client: openai.OpenAI, server: RunningServer, **kwargs) -> tuple[str, str | None]:
    chunks = [c for c in chat(client, server, stream=True, **kwargs) if c.choices]
    return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_with_a_pydantic_model(client: openai.OpenAI, server: RunningServer, temperature: float) -> None:
    for seed in range(3):
        resp = client.chat.completions.parse(model=server.model, messages=MESSAGES, response_format=Person,
                                             max_tokens=120, temperature=temperature, seed=seed)
        [choice] = resp.choices
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())


def test_json_schema_streamed_equals_whole(client: openai.OpenAI, server: RunningServer) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer"}},
              "required": ["ok", "n"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "flags", "schema": schema, "strict": True}}
    whole = chat(client, server, response_format=fmt, max_tokens=60, seed=4, temperature=1.0)
    streamed, finish = streamed_chat(client, server, response_format=fmt, max_tokens=60, seed=4, temperature=1.0)
    assert streamed == whole.choices[0].message.content and finish == whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed), schema)


def test_concurrent_constrained_requests_equal_their_solo_answers(client: openai.OpenAI, server: RunningServer) -> None:
    """Six at once: steps of several constrained rows, whose tokens the engine's grammar process consumes
    (learning of a completed grammar a step late): the same answers, streamed or not, as one at a time."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": Person.model_json_schema()}}
    kwargs = {"response_format": fmt, "max_tokens": 120, "temperature": 1.0}
    solo = [chat(client, server, seed=seed, **kwargs).choices[0].message.content for seed in range(6)]
    with ThreadPoolExecutor(6) as pool:
        together = list(pool.map(lambda seed: streamed_chat(client, server, seed=seed, **kwargs) if seed % 2 else
                                 (lambda c: (c.message.content, c.finish_reason))(
                                     chat(client, server, seed=seed, **kwargs).choices[0]), range(6)))
    assert together == [(text, "stop") for text in solo]
    for text in solo:
        Person.model_validate_json(text)


@pytest.mark.parametrize("stream", [False, True])
def test_json_object(client: openai.OpenAI, server: RunningServer, stream: bool) -> None:
    kwargs = {"response_format": {"type": "json_object"}, "max_tokens": 200, "seed": 2, "temperature": 1.0}
    if stream:
        text, finish = streamed_chat(client, server, **kwargs)
    else:
        choice = chat(client, server, **kwargs).choices[0]
        text, finish = choice.message.content, choice.finish_reason
    assert finish == "stop" and isinstance(json.loads(text), dict)


def test_text_format_is_plain_generation(client: openai.OpenAI, server: RunningServer) -> None:
    plain = chat(client, server, max_tokens=20, seed=9)
    text = chat(client, server, max_tokens=20, seed=9, response_format={"type": "text"})
    assert text.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("extra", [{"guided_choice": ["red", "green", "blue"]},
                                   {"structured_outputs": {"choice": ["red", "green", "blue"]}}])
def test_choice(client: openai.OpenAI, server: RunningServer, extra: dict) -> None:
    for seed in range(3):
        resp = chat(client, server, max_tokens=20, seed=seed, extra_body=extra)
        assert resp.choices[0].message.content in ("red", "green", "blue")
        assert resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra", [{"guided_regex": r"[0-9]{3}-[a-z]{2,4}"},
                                   {"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2,4}"}}])
def test_regex_on_completions_streamed_and_not(client: openai.OpenAI, server: RunningServer, extra: dict) -> None:
    kwargs = {"model": server.model, "prompt": "A code:", "max_tokens": 20, "seed": 3, "extra_body": extra}
    whole = client.completions.create(**kwargs).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    assert streamed == whole and re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", whole)


@pytest.mark.parametrize("extra", [{"guided_json": {"type": "object", "properties": {"x": {"enum": [1, 2]}},
                                                    "required": ["x"], "additionalProperties": False}},
                                   {"structured_outputs": {"json": '{"type": "array", "items": {"enum": [1, 2]},'
                                                                   ' "minItems": 1, "maxItems": 3}'}}])
def test_vllm_json_extras(client: openai.OpenAI, server: RunningServer, extra: dict) -> None:
    schema = extra.get("guided_json") or json.loads(extra["structured_outputs"]["json"])
    resp = chat(client, server, max_tokens=40, seed=1, extra_body=extra)
    jsonschema.validate(json.loads(resp.choices[0].message.content), schema)


def test_lark_grammar(client: openai.OpenAI, server: RunningServer) -> None:
    grammar = 'start: "ab" ("c" | "d")+ "!"'
    resp = chat(client, server, max_tokens=30, seed=5, extra_body={"structured_outputs": {"grammar": grammar}})
    assert re.fullmatch(r"ab[cd]+!", resp.choices[0].message.content)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}}, "response_format"),
    ({"guided_regex": "a(b"}, "guided_regex"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_grammar": "start: undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
def test_what_cannot_compile_is_a_400_naming_its_field(client: openai.OpenAI, server: RunningServer, body: dict,
                                                       param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, server, max_tokens=5, extra_body=body)
    assert raised.value.status_code == 400 and raised.value.body["param"] == param
    health = chat(client, server, max_tokens=3, seed=1)  # the engine never saw it
    assert health.choices[0].finish_reason in ("stop", "length")
