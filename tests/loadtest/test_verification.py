"""The load test's verifier catches what it claims to: served over a fake transport, no server."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from loadtest.run import (
    Answer,
    Prompt,
    Result,
    Target,
    make_prompts,
    raw_request,
    summarize,
)

TARGET = Target("http://fake", "m", "k")
PROMPT = Prompt(0, "#0 def", 4)
REFERENCE = Answer("abc", "length", 5, 3)


def chunk(content: str | None = None, tokens: int = 0, finish: str | None = None, first: bool = False,
          id_: str = "c1") -> dict:
    delta = {"role": "assistant", "content": content or ""} if first else {"content": content}
    logprobs = {"content": [{"token": "x", "logprob": -1.0, "bytes": [120]}] * tokens}
    return {"id": id_, "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], "usage": None}


def usage_chunk(completion: int = 3) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion}}


GOOD = [chunk("a", 1, first=True), chunk("b", 1), chunk("c", 1, "length"), usage_chunk(), "[DONE]"]


def serve(events: list) -> Result:
    return respond(200, "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events))


def respond(status: int, body: str) -> Result:
    async def go() -> Result:
        transport = httpx.MockTransport(lambda request: httpx.Response(status, text=body))
        async with httpx.AsyncClient(transport=transport) as http:
            return await raw_request(http, TARGET, PROMPT, REFERENCE, None)

    return asyncio.run(go())


def test_a_correct_stream_passes_and_is_timed() -> None:
    result = serve(GOOD)
    assert result.status == "ok" and result.problems == []
    assert result.output_tokens == 3 and len(result.itl) == 2 and result.latency >= result.ttft > 0


@pytest.mark.parametrize("events, problem", [
    (GOOD[:-1], "without data: [DONE]"),  # truncated before [DONE]
    (GOOD[:2] + GOOD[3:], "received 2 tokens, usage says 3"),  # a token's chunk lost
    ([chunk("a", 1, first=True), chunk("X", 1), chunk("c", 1, "length"), usage_chunk(), "[DONE]"], "differs"),
    (GOOD[:3] + ["[DONE]"], "no usage chunk"),
    (GOOD + [usage_chunk()], "data after [DONE]"),
    ([GOOD[0], "{not json", *GOOD[1:]], "not a JSON object"),
    ([chunk("a", 1), *GOOD[1:]], "role 'assistant'"),
    ([GOOD[0], chunk("b", 1, id_="other"), *GOOD[2:]], "different ids"),
    ([GOOD[0], chunk("b", 1, "stop"), *GOOD[2:]], "after the one with finish_reason"),
])
def test_broken_streams_are_wrong_answers(events: list, problem: str) -> None:
    result = serve(events)
    assert any(problem in p for p in result.problems), result.problems
    assert summarize([result], 1.0, None, None)["wrong_answers"] == 1


def test_error_statuses_are_counted_and_their_shape_checked() -> None:
    shaped = {"error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": "queue_full"}}
    busy = respond(429, json.dumps(shaped))
    assert busy.status == "429" and busy.problems == []
    bare = respond(500, '{"detail": "busy"}')
    assert bare.status == "500" and "OpenAI's shape" in bare.problems[0]


def test_an_error_event_in_a_stream_needs_done_after_it() -> None:
    error = {"error": {"message": "engine died", "type": "server_error", "param": None, "code": "engine_unavailable"}}
    assert serve([GOOD[0], error, "[DONE]"]).status == "stream_error:engine_unavailable"
    assert serve([GOOD[0], error, "[DONE]"]).problems == []
    assert "without data: [DONE]" in serve([GOOD[0], error]).problems[0]


def test_prompts_are_seeded_distinct_and_spread() -> None:
    prompts = make_prompts(200, 20, 32, 0.5, seed=3)
    assert prompts == make_prompts(200, 20, 32, 0.5, seed=3)
    assert len({p.text for p in prompts}) == 200
    assert {len(p.text.split()) - 1 for p in prompts} <= set(range(10, 31))
    assert min(p.max_tokens for p in prompts) >= 16 and max(p.max_tokens for p in prompts) <= 48
