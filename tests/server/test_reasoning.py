"""--reasoning-parser: the <think> section goes to reasoning_content, never into the content,
however the text is chunked; and through the server, streamed or not."""
from __future__ import annotations

import itertools
from collections.abc import Iterator

import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from moe_serve.server.reasoning import ReasoningStream
from tests.server.conftest import REPO, RunningServer, start_server

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


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    running: RunningServer = start_server(REPO / "moe_serve" / "models" / "default", tmp_path_factory.mktemp("logs"),
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
    constrained = client.chat.completions.create(response_format={"type": "json_object"}, **kwargs).choices[0]
    assert constrained.message.content and "reasoning_content" not in constrained.message.model_extra
