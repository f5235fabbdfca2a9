"""The harmony format end to end, through the OpenAI SDK, against a real server on a tiny random
gpt-oss checkpoint (needs the engine's gpt_oss family) with gpt-oss's own tokenizer: harmony turns
on by itself for it. A random model writes no harmony of its own, so each answer is forced into
the markup under test by a Lark grammar naming harmony's special tokens (structured_outputs'
grammar, which constrains the raw output), or, for the server's own constraints (a forced call, a
response_format), steered out of its reasoning by a logit_bias on <|end|>."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.server.conftest import RunningServer, start_server
from tests.server.harmony_tokenizer import FIRST_SPECIAL, VOCAB_SIZE
from tests.tiny_checkpoints import build_tiny_checkpoint

MODEL = "tiny-gpt-oss"
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"enum": ["Paris", "Tokyo"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
END = 200007  # <|end|>: biased up, a forced answer's reasoning ends at once
REASON_THEN_ANSWER = ('start: <|channel|> "analysis" <|message|> "It is <b>." <|end|> <|start|> "assistant" '
                      '<|channel|> "final" <|message|> "Hi 🙂 there" <|return|>')
CALL = ('start: <|channel|> "analysis" <|message|> "Ask the tool." <|end|> <|start|> "assistant" <|channel|> '
        '"commentary to=functions.get_weather " <|constrain|> "json" <|message|> "{\\"city\\":\\"Paris\\"}" <|call|>')


@pytest.fixture(scope="module")
def gpt_oss_server(gpt_oss_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    model = build_tiny_checkpoint("gpt_oss", tmp_path_factory.mktemp("ckpt") / MODEL, vocab_size=VOCAB_SIZE,
                                  max_position_embeddings=1024, bos_token_id=FIRST_SPECIAL,
                                  eos_token_id=200002, pad_token_id=FIRST_SPECIAL + 1)
    running = start_server(model, tmp_path_factory.mktemp("logs"), "--max-model-len", "1024",
                           "--tokenizer", str(gpt_oss_tokenizer_dir))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(gpt_oss_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=gpt_oss_server.base_url + "/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **kwargs):
    kwargs = {"messages": ASK, "seed": 1, "max_tokens": 48, **kwargs}
    return client.chat.completions.create(model=MODEL, **kwargs)


def streamed(client: openai.OpenAI, **kwargs) -> tuple[str, str, list[list[str]], str | None]:
    """(reasoning, content, [name, arguments] per call, finish_reason) from a stream's deltas."""
    reasoning = content = ""
    calls: list[list[str]] = []
    finish = None
    for chunk in chat(client, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        content += delta.content or ""
        for piece in delta.tool_calls or ():
            if piece.index == len(calls):
                assert piece.id.startswith("call_") and piece.type == "function"
                calls.append([piece.function.name, ""])
            calls[piece.index][1] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return reasoning, content, calls, finish


def test_reasoning_and_content_streamed_or_not(client: openai.OpenAI) -> None:
    forced = {"structured_outputs": {"grammar": REASON_THEN_ANSWER}}
    choice = chat(client, extra_body=forced).choices[0]
    assert (choice.message.model_extra["reasoning_content"], choice.message.content, choice.finish_reason) == \
        ("It is <b>.", "Hi 🙂 there", "stop")
    assert streamed(client, extra_body=forced) == ("It is <b>.", "Hi 🙂 there", [], "stop")


def test_a_call_in_harmony_is_a_tool_call_streamed_or_not(client: openai.OpenAI) -> None:
    forced = {"structured_outputs": {"grammar": CALL}}
    choice = chat(client, tools=TOOLS, extra_body=forced).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Ask the tool."
    [call] = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city":"Paris"}')
    assert streamed(client, tools=TOOLS, extra_body=forced) == \
        ("Ask the tool.", "", [["get_weather", '{"city":"Paris"}']], "tool_calls")
    whole = chat(client, tools=TOOLS, extra_body=forced)
    cut = chat(client, tools=TOOLS, extra_body=forced, max_tokens=whole.usage.completion_tokens - 2).choices[0]
    arguments = cut.message.tool_calls[0].function.arguments  # without their last token, and no <|call|>
    assert cut.finish_reason == "length" and '{"city":"Paris"}'.startswith(arguments) and arguments != '{"city":"Paris"}'


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_calls_are_written_in_harmony(client: openai.OpenAI, tool_choice) -> None:
    choice = chat(client, tools=TOOLS, tool_choice=tool_choice, logit_bias={str(END): 100}).choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Tokyo")


def test_response_format_constrains_the_final_answer(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    choice = chat(client, response_format=fmt, logit_bias={str(END): 100}).choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content)["a"] in (1, 2)


def test_an_agent_turn_is_sent_back_and_rendered(client: openai.OpenAI, gpt_oss_server: RunningServer) -> None:
    first = chat(client, tools=TOOLS, extra_body={"structured_outputs": {"grammar": CALL}}).choices[0].message
    history = ASK + [first,  # the SDK's message sent back as is: its reasoning_content and tool call
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"celsius": 21}'}]
    answer = chat(client, messages=history, tools=TOOLS, reasoning_effort="low",
                  extra_body={"structured_outputs": {"grammar": REASON_THEN_ANSWER}})
    assert answer.choices[0].message.content == "Hi 🙂 there"
    tokenized = gpt_oss_server.post("/tokenize", json={"model": MODEL, "messages": json.loads(json.dumps(
        history, default=lambda m: m.model_dump(exclude_none=True))), "tools": TOOLS, "reasoning_effort": "low",
        "return_token_strs": True}).json()
    assert tokenized["count"] == answer.usage.prompt_tokens
    text = "".join(tokenized["token_strs"])
    assert "Reasoning: low" in text and "<|channel|>analysis<|message|>Ask the tool.<|end|>" in text
    assert '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"celsius": 21}' in text


def test_the_responses_api_gives_the_reasoning_as_an_item(client: openai.OpenAI) -> None:
    """Greedy, the random model starts with reasoning, which it never ends: a lone reasoning item."""
    kwargs = {"model": MODEL, "input": "Hi", "reasoning": {"effort": "high"}, "temperature": 0, "max_output_tokens": 16,
              "text": {"format": {"type": "json_object"}}}
    response = client.responses.create(**kwargs)
    [item] = response.output
    assert item.type == "reasoning" and item.content[0].text and "<|" not in item.content[0].text
    assert response.reasoning.effort == "high" and response.status == "incomplete"
    events = list(client.responses.create(stream=True, **kwargs))
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == item.content[0].text
    assert events[-1].response.output[0].content[0].text == item.content[0].text
    assert events[-1].response.usage == response.usage and response.usage.output_tokens_details.reasoning_tokens > 0


def analysis_tokens(logprobs: list) -> int:
    """The tokens of the text of an answer's first message, its analysis (to its end, if cut), from its
    logprobs (the model may spell the header's "analysis" in several tokens)."""
    tokens = [entry.token for entry in logprobs] + ["<|end|>"]
    start = tokens.index("<|message|>")
    return tokens.index("<|end|>", start) - start - 1


def test_usage_counts_the_analysis_tokens_as_reasoning_streamed_or_not(client: openai.OpenAI) -> None:
    answer = chat(client, logprobs=True, extra_body={"structured_outputs": {"grammar": REASON_THEN_ANSWER}})
    details = answer.usage.completion_tokens_details
    assert details.reasoning_tokens == analysis_tokens(answer.choices[0].logprobs.content) > 0
    *_, last = chat(client, stream=True, stream_options={"include_usage": True},
                    extra_body={"structured_outputs": {"grammar": REASON_THEN_ANSWER}})
    assert last.usage == answer.usage
    final_only = 'start: <|channel|> "final" <|message|> "Hi" <|return|>'
    assert chat(client, extra_body={"structured_outputs": {"grammar": final_only}}) \
        .usage.completion_tokens_details.reasoning_tokens == 0


def test_a_reasoning_item_sent_back_is_rendered_on_the_analysis_channel(client: openai.OpenAI,
                                                                        gpt_oss_server: RunningServer) -> None:
    """A client keeping its own history (store false) sends turn 1's output items back as turn 2's input."""
    first = client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "high"}, temperature=0,
                                    max_output_tokens=16, store=False, text={"format": {"type": "json_object"}})
    [item] = first.output  # greedy, the random model reasons to the end: a lone reasoning item
    reasoning = item.content[0].text
    same = chat(client, messages=[{"role": "user", "content": "Hi"}], reasoning_effort="high", temperature=0,
                max_tokens=16, response_format={"type": "json_object"}, logprobs=True).choices[0]
    assert same.message.model_extra["reasoning_content"] == reasoning
    assert first.usage.output_tokens_details.reasoning_tokens == analysis_tokens(same.logprobs.content) > 0
    ask = [{"role": "user", "content": "Hi"}]
    again = [{"role": "user", "content": "Go on"}]
    second = client.responses.create(model=MODEL, max_output_tokens=1, store=False,
                                     input=[*ask, item.model_dump(), *again])
    sealed = {**item.model_dump(exclude_none=True), "encrypted_content": "gAAAAB-unreadable"}  # beside readable text
    assert client.responses.create(model=MODEL, max_output_tokens=1, store=False, input=[*ask, sealed, *again]) \
        .usage.input_tokens == second.usage.input_tokens
    tokens = gpt_oss_server.post("/tokenize", json={"model": MODEL, "messages": [
        *ask, {"role": "assistant", "content": None, "reasoning_content": reasoning}, *again]}).json()["tokens"]
    assert len(tokens) == second.usage.input_tokens
    prompt = gpt_oss_server.post("/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert prompt.endswith(f"<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>"
                           f"{reasoning}<|end|><|start|>user<|message|>Go on<|end|><|start|>assistant")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input=[*ask, {"type": "reasoning", "summary": [],
                                                           "encrypted_content": "gAAAAB-unreadable"}])
    assert info.value.body["param"] == "input.1.encrypted_content"
