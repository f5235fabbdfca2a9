"""POST /v1/responses through the OpenAI SDK (client.responses), streamed and not, against the real
server: the answer equals the chat path's for the same conversation and seed; the documented event
sequence; usage; store / GET / previous_response_id; built-in tools refused by name."""
from __future__ import annotations

import json

import openai
import pytest

from moe_serve.server.prompts import chat_prompts
from moe_serve.server.protocol import ResponsesRequest
from moe_serve.server.responses_api import OutputItems, _as_chat
from moe_serve.server.tokenizer import Tokenizer
from tests.server.conftest import DEFAULT_MODEL, RunningServer


def test_a_response_is_the_chat_answer_in_the_responses_shape(client: openai.OpenAI, server: RunningServer) -> None:
    resp = client.responses.create(model=server.model, input="def add(a, b):", instructions="Write Python.",
                                   max_output_tokens=12, temperature=0, top_p=0.9)
    chat = client.chat.completions.create(model=server.model, max_tokens=12, temperature=0, top_p=0.9,
                                          messages=[{"role": "system", "content": "Write Python."},
                                                    {"role": "user", "content": "def add(a, b):"}])
    assert resp.output_text == chat.choices[0].message.content
    assert resp.object == "response" and resp.id.startswith("resp_") and resp.model == server.model
    [message] = resp.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert resp.output_text == message.content[0].text
    assert resp.usage.input_tokens == chat.usage.prompt_tokens
    assert resp.usage.output_tokens_details.reasoning_tokens == 0  # no reasoning parser, no harmony
    assert chat.usage.completion_tokens_details.reasoning_tokens == 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    assert (resp.status, resp.incomplete_details is not None) in {("completed", False), ("incomplete", True)}
    assert resp.status == "completed" or resp.usage.output_tokens == 12


def test_stream_events_follow_the_documented_sequence(client: openai.OpenAI, server: RunningServer) -> None:
    events = list(client.responses.create(model=server.model, input=[{"role": "user", "content": "hello"}],
                                          max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[:4] == head and kinds[-4:-1] == tail and kinds[-1] in ("response.completed", "response.incomplete")
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text == events[-4].text and final.usage.output_tokens > 0
    stored = client.responses.retrieve(final.id)
    assert stored.output_text == text and stored.id == final.id


def test_store_and_previous_response_id_continue_the_conversation(client: openai.OpenAI,
                                                                   server: RunningServer) -> None:
    first = client.responses.create(model=server.model, input="hello", max_output_tokens=5)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(model=server.model, input="and again", max_output_tokens=5,
                                     previous_response_id=first.id)
    chat = client.chat.completions.create(model=server.model, max_tokens=1, messages=[
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and again"}])
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    unstored = client.responses.create(model=server.model, input="hello", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(model=server.model, input="x", previous_response_id="resp_nope")
    assert info.value.body["param"] == "previous_response_id"


def test_text_format_is_the_chat_paths_response_format(client: openai.OpenAI, server: RunningServer) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    resp = client.responses.create(model=server.model, input="hi", max_output_tokens=60,
                                   text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert resp.status == "completed" and json.loads(resp.output_text)["a"] in ("x", "y")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "name": "bad name!"}], "tool_choice": "required"}, "tools.0.function.name"),
    ({"reasoning": {"effort": "low"}}, "reasoning.effort"),  # the harmony format's (tests/server/test_harmony*)
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input.0.content"),
    ({"input": [{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]},
     "input.1.encrypted_content"),  # none is issued here, so none can be read
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"type": "item_reference", "id": "rs_1"}]}, "input.0.type"),
])
def test_what_is_not_served_is_a_400_naming_it(client: openai.OpenAI, server: RunningServer, fields: dict,
                                               param: str) -> None:
    body = {"model": server.model, "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.post("/responses", body=body, cast_to=object)
    assert info.value.body["param"] == param


TOOLS = [{"type": "function", "name": "add", "description": "Add two numbers",
          "parameters": {"type": "object", "properties": {"a": {"enum": [2, 3]}, "b": {"enum": [2, 3]}},
                         "required": ["a", "b"], "additionalProperties": False}}]  # short answers from a random model


def test_function_tools_give_function_call_items_and_take_their_outputs(client: openai.OpenAI,
                                                                         server: RunningServer) -> None:
    # "required" is enforced by the grammar engine: it works on any model, without a tool-call parser
    resp = client.responses.create(model=server.model, input="add 2 and 3", tools=TOOLS, tool_choice="required",
                                   parallel_tool_calls=False, max_output_tokens=100, temperature=0)
    [call] = [item for item in resp.output if item.type == "function_call"]
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"} and call.call_id
    streamed = list(client.responses.create(model=server.model, input="add 2 and 3", tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            max_output_tokens=100, temperature=0, stream=True))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments and streamed[-1].response.output[-1].arguments == call.arguments
    # the call's result goes back as input items; the conversation goes on from the stored response too
    answer = client.responses.create(model=server.model, max_output_tokens=3, previous_response_id=resp.id,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "5"}])
    again = client.responses.create(model=server.model, max_output_tokens=3, input=[
        {"role": "user", "content": "add 2 and 3"},
        {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "5"}])
    assert answer.usage.input_tokens == again.usage.input_tokens


def test_reasoning_is_an_item_of_its_own_before_the_message() -> None:
    items = OutputItems()
    events = [*items.add_reasoning("Think"), *items.add_reasoning("ing."), *items.add_text("Hi"), *items.close("completed")]
    assert [kind for kind, _ in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done", "response.output_text.done", "response.content_part.done",
        "response.output_item.done"]
    reasoning, message = items.items
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text", "text": "Thinking."}]
    assert message["content"][0]["text"] == "Hi" and events[7][1]["output_index"] == 0
    assert items.as_chat_message() == {"role": "assistant", "content": "Hi", "reasoning_content": "Thinking."}


THINK_TEMPLATE = ("{% for m in messages %}[{{ m.role }}]{% if m.reasoning_content %}<think>{{ m.reasoning_content }}"
                  "</think>{% endif %}{{ m.content }}{% for c in m.tool_calls or [] %}<call {{ c.id }}>{% endfor %}"
                  "{% endfor %}")


def test_a_reasoning_item_is_the_reasoning_content_of_the_assistant_turn_it_opens() -> None:
    """An answer's items sent back (reasoning, message, calls) are one assistant turn, as the chat path
    gives it to the template; a summary stands in for absent content; unreadable encrypted content beside
    readable text is ignored. (The harmony format renders it on the analysis channel: test_harmony*.)"""
    message = {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
               "content": [{"type": "output_text", "text": "Let me add.", "annotations": [], "logprobs": None}]}
    call = {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}", "id": "fc_1", "status": None}
    body = ResponsesRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "add 2 and 3"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAA", "status": "completed",
         "content": [{"type": "reasoning_text", "text": "Use "}, {"type": "reasoning_text", "text": "add."}]},
        message, call, {"type": "function_call_output", "call_id": "c1", "output": "5"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Done."},
                                          {"type": "summary_text", "text": "Say it."}]},
        {**message, "content": [{"type": "output_text", "text": "5"}]},
        {"role": "user", "content": "thanks"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "Cut short"}]}]})  # reasoned only
    tokenizer = Tokenizer(str(DEFAULT_MODEL), chat_template=THINK_TEMPLATE)
    [ids] = chat_prompts(_as_chat(body, body.messages()), tokenizer)
    assert tokenizer.decode(ids) == ("[user]add 2 and 3[assistant]<think>Use add.</think>Let me add.<call c1>[tool]5"
                                     "[assistant]<think>Done.\n\nSay it.</think>5[user]thanks"
                                     "[assistant]<think>Cut short</think>")
