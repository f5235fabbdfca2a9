"""--reasoning-parser: the <think> section goes to reasoning_content, never into the content,
however the text is chunked; and through the server, streamed or not."""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_serve.engine.messages import RequestOutput, SamplingParams
from moe_serve.server.choice import ChoiceDecoder, TextOptions
from moe_serve.server.reasoning import ReasoningStream
from moe_serve.server.tokenizer import Tokenizer
from tests.server.conftest import DEFAULT_MODEL, RunningServer, start_server

THOUGHT = "The user wants x < y, so </thin is not the end; <think> inside stays."
ANSWER = "\n\nx = 1"
CASES = [  # (parser, answer text, reasoning, content)
    ("deepseek_r1", f"{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("deepseek_r1", f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("deepseek_r1", THOUGHT, THOUGHT, ""),  # never closed: cut by max_tokens while thinking
    ("qwen3", f"<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("qwen3", f"\n<think>{THOUGHT}</think>{ANSWER}", THOUGHT, ANSWER),
    ("qwen3", f"No thinking here: <think>{THOUGHT}", "", f"No thinking here: <think>{THOUGHT}"),
    ("qwen3", "<thi", "", "<thi"),
]


def split(parser: str, pieces: list[str]) -> tuple[str, str]:
    stream = ReasoningStream(parser)
    reasoning = content = ""
    for i, piece in enumerate(pieces):
        r, c = stream.feed(piece, final=i == len(pieces) - 1)
        reasoning, content = reasoning + r, content + c
    return reasoning, content


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
@given(cuts=st.lists(st.integers(min_value=0), max_size=10))
def test_any_chunking_gives_the_same_split(parser: str, text: str, reasoning: str, content: str,
                                           cuts: list[int]) -> None:
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in itertools.pairwise(bounds)] + [""]
    assert split(parser, pieces) == (reasoning, content)


@pytest.mark.parametrize(("parser", "text", "reasoning"), [
    ("qwen3", "<think>The user wants x</think>\n\nx = 1", "The user wants x"),
    ("deepseek_r1", "The user wants x</think>\n\nx = 1", "The user wants x"),
    ("deepseek_r1", "The user wants x < y", "The user wants x < y"),  # never closed: all reasoning
    ("qwen3", "No thinking here: <think>x", ""),
])
@pytest.mark.parametrize("step", [1, 4, 1000])
def test_reasoning_tokens_are_those_whose_text_is_the_reasoning(parser: str, text: str, reasoning: str,
                                                                step: int) -> None:
    """The tags' tokens are not counted; the count does not depend on how the engine chunks the answer."""
    tokenizer = Tokenizer(str(DEFAULT_MODEL))
    ids = tokenizer.encode(text, add_special_tokens=False)
    choice = ChoiceDecoder(0, tokenizer, TextOptions(), SamplingParams(max_tokens=len(ids)),
                           reasoning=ReasoningStream(parser))
    for a in range(0, len(ids), step):
        last = a + step >= len(ids)
        choice.consume(RequestOutput("r", tuple(ids[a:a + step]), finish_reason="length" if last else None))
    assert choice.reasoning_tokens == len(tokenizer.encode(reasoning, add_special_tokens=False))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    running: RunningServer = start_server(DEFAULT_MODEL, tmp_path_factory.mktemp("logs"),
                                          "--reasoning-parser", "deepseek_r1")
    yield openai.OpenAI(base_url=running.base_url + "/v1", api_key="unused", max_retries=0)
    running.stop()


def test_reasoning_content_streamed_or_not(client: openai.OpenAI) -> None:
    """The default model never closes a <think> the deepseek_r1 parser assumes open: all reasoning."""
    kwargs = {"model": "default", "messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 16,
              "seed": 3}
    message = client.chat.completions.create(**kwargs).choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and message.content == ""
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == ""
    constrained = client.chat.completions.create(response_format={"type": "json_object"}, **kwargs)
    message = constrained.choices[0].message
    assert message.content and "reasoning_content" not in message.model_extra
    assert constrained.usage.completion_tokens_details.reasoning_tokens == 0


def test_usage_counts_the_reasoning_tokens_on_both_apis(client: openai.OpenAI) -> None:
    """Greedy, the default model never closes the <think> deepseek_r1 opens: every token but EOS reasons."""
    ask = {"model": "default", "temperature": 0}
    answer = client.chat.completions.create(messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=16,
                                            logprobs=True, **ask)
    reasoning = answer.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and answer.choices[0].message.content == ""
    assert answer.usage.completion_tokens_details.reasoning_tokens == len(answer.choices[0].logprobs.content) > 0
    *_, last = client.chat.completions.create(messages=[{"role": "user", "content": "def add(a, b):"}], max_tokens=16,
                                              stream=True, stream_options={"include_usage": True}, **ask)
    assert last.usage == answer.usage
    response = client.responses.create(input="def add(a, b):", max_output_tokens=16, store=False, **ask)
    [item] = response.output  # the Responses API splits it too: a reasoning item
    assert item.type == "reasoning" and item.content[0].text == reasoning
    reasoning_tokens = answer.usage.completion_tokens_details.reasoning_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == reasoning_tokens
