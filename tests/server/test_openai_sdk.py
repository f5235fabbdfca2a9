"""The official OpenAI SDK (sync, async, streaming) against a real server and engine on the CPU."""
from __future__ import annotations

import asyncio

import openai
import pytest

from moe_serve.server.tokenizer import Tokenizer
from tests.server.conftest import RunningServer

MESSAGES = [{"role": "user", "content": "Tell me a story about 日本 🙂"}]


def chat(client: openai.OpenAI, server: RunningServer, **kwargs):
    return client.chat.completions.create(model=server.model, messages=kwargs.pop("messages", MESSAGES), **kwargs)


def streamed_chat(client: openai.OpenAI, server: RunningServer, **kwargs) -> tuple[str, list]:
    chunks = list(chat(client, server, stream=True, **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_chat_shape_and_exact_usage(client: openai.OpenAI, server: RunningServer, tokenizer: Tokenizer) -> None:
    resp = chat(client, server, max_tokens=12, seed=1)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == server.model
    [choice] = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant" and choice.logprobs is None
    assert resp.usage.prompt_tokens == len(tokenizer.chat_prompt_ids(MESSAGES))
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    if choice.finish_reason == "length":
        assert resp.usage.completion_tokens == 12
    else:
        assert choice.finish_reason == "stop" and resp.usage.completion_tokens < 12


def test_same_seed_same_text_streamed_or_not(client: openai.OpenAI, server: RunningServer) -> None:
    plain = chat(client, server, max_tokens=30, seed=7, temperature=1.0)
    again = chat(client, server, max_tokens=30, seed=7, temperature=1.0)
    streamed, _ = streamed_chat(client, server, max_tokens=30, seed=7, temperature=1.0)
    other = chat(client, server, max_tokens=30, seed=8, temperature=1.0)
    assert plain.choices[0].message.content == again.choices[0].message.content == streamed
    assert other.choices[0].message.content != plain.choices[0].message.content


def test_stream_chunks_and_usage(client: openai.OpenAI, server: RunningServer) -> None:
    text, chunks = streamed_chat(client, server, max_tokens=20, seed=3, stream_options={"include_usage": True})
    plain = chat(client, server, max_tokens=20, seed=3)
    assert {c.id for c in chunks} == {chunks[0].id} and {c.created for c in chunks} == {chunks[0].created}
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    *content, final = chunks
    assert final.choices == [] and final.usage.model_dump() == plain.usage.model_dump()
    assert all(c.usage is None for c in content)
    assert content[-1].choices[0].finish_reason == plain.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert text == plain.choices[0].message.content


def test_n_choices_use_consecutive_seeds(client: openai.OpenAI, server: RunningServer) -> None:
    many = chat(client, server, max_tokens=10, seed=11, n=3)
    singles = [chat(client, server, max_tokens=10, seed=11 + i) for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens  # the prompt counts once
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)


def test_stop_string_spanning_tokens_is_cut_and_never_leaked(client: openai.OpenAI, server: RunningServer) -> None:
    full = chat(client, server, max_tokens=40, seed=21).choices[0].message.content
    middle = len(full) // 2
    stop = full[middle:middle + 3]  # three characters: at least three tokens with this tokenizer
    assert len(stop) == 3, full
    expected = full[: full.find(stop)]
    cut = chat(client, server, max_tokens=40, seed=21, stop=[stop, "never-generated"])
    assert cut.choices[0].message.content == expected and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < 40
    text, chunks = streamed_chat(client, server, max_tokens=40, seed=21, stop=stop)
    assert text == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_never_hit_changes_nothing(client: openai.OpenAI, server: RunningServer) -> None:
    plain = chat(client, server, max_tokens=15, seed=5)
    with_stop = chat(client, server, max_tokens=15, seed=5, stop="\x00\x00 never")
    assert with_stop.choices[0].message.content == plain.choices[0].message.content
    assert with_stop.choices[0].finish_reason == plain.choices[0].finish_reason


def test_eos_token_finishes_with_stop(client: openai.OpenAI, server: RunningServer, tokenizer: Tokenizer) -> None:
    resp = client.completions.create(model=server.model, prompt="once upon a time", max_tokens=64, n=16, seed=0,
                                     temperature=2.0, logprobs=0)
    stopped = [c for c in resp.choices if c.finish_reason == "stop"]
    assert stopped, "no choice sampled EOS; pick another seed"
    for choice in stopped:
        # EOS is a generated token (counted in usage) but neither text nor a logprobs entry
        assert len(choice.logprobs.tokens) < 64
    lengths = [c for c in resp.choices if c.finish_reason == "length"]
    assert all(len(c.logprobs.tokens) == 64 for c in lengths)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) + (c.finish_reason == "stop")
                                               for c in resp.choices)


def test_chat_logprobs_greedy(client: openai.OpenAI, server: RunningServer) -> None:
    resp = chat(client, server, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    entries = resp.choices[0].logprobs.content
    assert len(entries) == resp.usage.completion_tokens - (resp.choices[0].finish_reason == "stop")
    for entry in entries:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode("utf-8"))
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert tops[0] == pytest.approx(entry.logprob)  # greedy picks the most likely token
    _, chunks = streamed_chat(client, server, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in entries]


def test_completion_logprobs(client: openai.OpenAI, server: RunningServer) -> None:
    resp = client.completions.create(model=server.model, prompt="hello", max_tokens=6, seed=2, logprobs=2)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(lp_ <= 0 for lp_ in lp.token_logprobs) and all(1 <= len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_completion_prompt_forms(client: openai.OpenAI, server: RunningServer, tokenizer: Tokenizer) -> None:
    def complete(prompt, **kwargs):
        return client.completions.create(model=server.model, prompt=prompt, max_tokens=6, seed=4, **kwargs)

    text = complete("hello")
    ids = tokenizer.encode("hello")
    assert complete(ids).choices[0].text == text.choices[0].text
    assert text.object == "text_completion" and text.id.startswith("cmpl-")
    both = complete(["hello", "world"], n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == text.choices[0].text
    assert both.usage.prompt_tokens == len(ids) + len(tokenizer.encode("world"))
    lists = complete([ids, tokenizer.encode("world")], n=2)
    assert [c.text for c in lists.choices] == [c.text for c in both.choices]


def test_text_parts_equal_string_content(client: openai.OpenAI, server: RunningServer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "Tell me a story about "},
                                          {"type": "text", "text": "日本 🙂"}]}]
    a = chat(client, server, messages=parts, max_tokens=8, seed=9)
    b = chat(client, server, max_tokens=8, seed=9)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_models_list(client: openai.OpenAI, server: RunningServer) -> None:
    [card] = client.models.list().data
    assert card.id == server.model and card.object == "model"


def test_async_concurrent_requests_match_sequential(client: openai.OpenAI, server: RunningServer) -> None:
    seeds = list(range(100, 106))
    expected = [chat(client, server, max_tokens=12, seed=s).choices[0].message.content for s in seeds]

    async def one(aclient: openai.AsyncOpenAI, seed: int) -> str:
        if seed % 2:
            stream = await aclient.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=12,
                                                           seed=seed, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        resp = await aclient.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=12,
                                                     seed=seed)
        return resp.choices[0].message.content

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0) as ac:
            return await asyncio.gather(*(one(ac, s) for s in seeds))

    assert asyncio.run(run_all()) == expected
