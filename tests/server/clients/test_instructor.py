"""instructor on the OpenAI SDK against the real server: TOOLS (a forced function call) and JSON_SCHEMA
(response_format json_schema) both return the validated pydantic model."""
from __future__ import annotations

import instructor
import openai
import pytest

from tests.server.clients.conftest import Point


@pytest.mark.parametrize("mode", [instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA])
def test_mode_returns_the_pydantic_model(base_url: str, mode: instructor.Mode) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0), mode=mode)
    point, completion = client.chat.completions.create_with_completion(
        model="default", response_model=Point, max_retries=0, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Give a point."}])
    assert isinstance(point, Point)  # instructor returns a subclass of the model it was given
    choice = completion.choices[0]
    if mode == instructor.Mode.JSON_SCHEMA:
        assert choice.finish_reason == "stop" and Point.model_validate_json(choice.message.content).model_dump() == point.model_dump()
    else:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert call.function.name == "Point" and Point.model_validate_json(call.function.arguments).model_dump() == point.model_dump()


def test_streamed_partial_objects_end_in_the_model(base_url: str) -> None:
    client = instructor.from_openai(openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0),
                                    mode=instructor.Mode.TOOLS)
    partials = list(client.chat.completions.create_partial(
        model="default", response_model=Point, max_retries=0, max_tokens=48, temperature=0,
        messages=[{"role": "user", "content": "Give a point."}]))
    assert len(partials) > 1
    Point.model_validate(partials[-1].model_dump())
