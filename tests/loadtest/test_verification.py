"""The load test's verifier catches what it claims to: served over a fake transport, no server."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from loadtest.run import (
    Answer,
    Divergence,
    Match,
    Prompt,
    Result,
    Target,
    Token,
    divergences,
    fetch_reference,
    make_prompts,
    parse_args,
    raw_request,
    sdk_request,
    summarize,
)

TARGET = Target("http://fake", "m", "k")
PROMPT = Prompt(0, "#0 def", 4)
REFERENCE = Answer("abc", "length", 5, 3)


def chunk(content: str | None = None, tokens: int = 0, finish: str | None = None, first: bool = False,
          id_: str = "c1", entries: list[dict] | None = None) -> dict:
    delta = {"role": "assistant", "content": content or ""} if first else {"content": content}
    entries = entries if entries is not None else [{"token": "x", "logprob": -1.0, "bytes": [120]}] * tokens
    logprobs = {"content": entries}
    return {"id": id_, "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], "usage": None}


def usage_chunk(completion: int = 3) -> dict:
    return {"id": "c1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [],
            "usage": {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5 + completion}}


GOOD = [chunk("a", 1, first=True), chunk("b", 1), chunk("c", 1, "length"), usage_chunk(), "[DONE]"]


def sse(events: list) -> str:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events)


def serve(events: list, reference: Answer = REFERENCE, match: Match = "exact", sent: list | None = None) -> Result:
    return respond(200, sse(events), reference, match, sent)


def respond(status: int, body: str, reference: Answer = REFERENCE, match: Match = "exact",
            sent: list | None = None) -> Result:
    def reply(request: httpx.Request) -> httpx.Response:
        (sent if sent is not None else []).append(json.loads(request.content))
        return httpx.Response(status, text=body)

    async def go() -> Result:
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply)) as http:
            return await raw_request(http, TARGET, PROMPT, reference, None, match)

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


# ---- --match top5: vLLM's check_logprobs_close --------------------------------------------------
# The reference greedily took a, b, c; at token 1 "b" won a near-tie against "B".

def top(token: str, *others: str) -> Token:
    return Token(token, (token, *others, *"vwxyz")[:5])


TOP5_REFERENCE = Answer("abc", "length", 5, 3, (top("a"), top("b", "B"), top("c")))


def entry(token: Token) -> dict:
    alternatives = [{"token": t, "logprob": -2.0, "bytes": list(t.encode())} for t in token.top]
    return {"token": token.text, "logprob": -1.0, "bytes": list(token.text.encode()), "top_logprobs": alternatives}


def top5_events(tokens: list[Token], finish: str = "length", text: str | None = None) -> list:
    """One chunk per token, its text the token's (or text's letters), then usage and [DONE]."""
    letters = text or "".join(t.text for t in tokens)
    chunks = [chunk(letters[i], finish=finish if i == len(tokens) - 1 else None, first=i == 0, entries=[entry(t)])
              for i, t in enumerate(tokens)]
    return [*chunks, usage_chunk(len(tokens) + (finish == "stop")), "[DONE]"]


SAME = [top("a"), top("b", "B"), top("c")]
DIVERGED = [top("a"), top("B", "b"), top("q")]  # "B" in the reference's top-5 at 1, "b" in the answer's


def serve_top5(events: list) -> Result:
    return serve(events, TOP5_REFERENCE, "top5")


def test_exact_is_the_default_and_asks_for_no_top_logprobs() -> None:
    assert parse_args(["--base-url", "http://x"]).match == "exact"
    assert parse_args(["--base-url", "http://x", "--match", "top5"]).match == "top5"
    with pytest.raises(SystemExit):
        parse_args(["--base-url", "http://x", "--match", "top3"])
    exact: list[dict] = []
    top5: list[dict] = []
    assert serve(GOOD, sent=exact).problems == []
    assert serve(top5_events(SAME), TOP5_REFERENCE, "top5", sent=top5).problems == []
    assert "top_logprobs" not in exact[0] and exact[0]["logprobs"] is True
    assert top5[0]["top_logprobs"] == 5 and top5[0]["logprobs"] is True


def test_exact_rejects_a_divergence_that_top5_accepts() -> None:
    assert "differs" in serve(top5_events(DIVERGED), TOP5_REFERENCE, "exact").problems[0]


def test_top5_without_a_divergence_passes_and_counts_none() -> None:
    result = serve_top5(top5_events(SAME))
    assert result.status == "ok" and result.problems == [] and result.divergence is None
    assert divergences([result])["diverged_within_top5"] == 0


def test_top5_accepts_a_divergence_within_both_top5s_and_counts_it() -> None:
    result = serve_top5(top5_events(DIVERGED))  # text "aBq" differs from "abc": it followed another path
    assert result.status == "ok" and result.problems == []
    assert result.divergence == Divergence(1, "B", "b")
    report = {**summarize([result], 1.0, None, None), **divergences([result])}
    assert report["wrong_answers"] == 0 and report["completed"] == 1 and report["diverged_within_top5"] == 1
    assert report["diverged_examples"] == [{"prompt": 0, "via": "raw", "position": 1, "answer_token": "B",
                                            "reference_token": "b"}]


def test_top5_after_a_divergence_lengths_and_finish_reason_may_differ() -> None:
    result = serve_top5(top5_events([top("a"), top("B", "b")], finish="stop"))  # EOS after "B"
    assert result.problems == [] and result.divergence == Divergence(1, "B", "b")


@pytest.mark.parametrize("tokens, problem", [
    ([top("a"), top("Z", "b"), top("c")], "token 1: answer 'Z', reference 'b': the answer's token is not in the "
                                          "reference's top-5"),
    ([top("a"), top("B"), top("c")], "token 1: answer 'B', reference 'b': the reference's token is not in the "
                                     "answer's top-5"),
    ([top("Z"), top("b", "B"), top("c")], "token 0: answer 'Z', reference 'a': the answer's token is not in the "
                                          "reference's top-5 ['a', 'v', 'w', 'x', 'y']; the reference's token is "
                                          "not in the answer's top-5"),
])
def test_top5_rejects_a_divergence_outside_either_top5(tokens: list[Token], problem: str) -> None:
    result = serve_top5(top5_events(tokens))
    assert any(p.startswith(problem) for p in result.problems), result.problems
    assert result.divergence is None and divergences([result])["diverged_within_top5"] == 0
    assert summarize([result], 1.0, None, None)["wrong_answers"] == 1


@pytest.mark.parametrize("events, problem", [
    (top5_events(SAME, finish="stop"), "differs"),  # the same tokens, then EOS instead of the length limit
    (top5_events(SAME, text="abX"), "differs"),  # the same tokens, other text
    (top5_events(SAME[:2]), "2 tokens, the reference 3, equal as far as both go"),  # cut short
    (top5_events([*SAME, top("d")]), "4 tokens, the reference 3"),
])
def test_top5_without_a_divergence_is_exact(events: list, problem: str) -> None:
    result = serve_top5(events)
    assert any(problem in p for p in result.problems), result.problems
    assert summarize([result], 1.0, None, None)["wrong_answers"] == 1


def _with_prompt_tokens(events: list, prompt_tokens: int) -> list:
    usage = {**events[-2]["usage"], "prompt_tokens": prompt_tokens}
    return [*events[:-2], {**events[-2], "usage": usage}, events[-1]]


DIVERGED_EVENTS = top5_events(DIVERGED)


@pytest.mark.parametrize("events, problem", [
    (DIVERGED_EVENTS[:-1], "without data: [DONE]"),
    (DIVERGED_EVENTS + [usage_chunk()], "data after [DONE]"),
    ([DIVERGED_EVENTS[0], {**DIVERGED_EVENTS[1], "id": "other"}, *DIVERGED_EVENTS[2:]], "different ids"),
    ([{**DIVERGED_EVENTS[0], "choices": [{**DIVERGED_EVENTS[0]["choices"][0], "delta": {"content": "a"}}]},
      *DIVERGED_EVENTS[1:]], "role 'assistant'"),
    ([*DIVERGED_EVENTS[:-2], usage_chunk(4), "[DONE]"], "received 3 tokens, usage says 4"),
    ([DIVERGED_EVENTS[0], *DIVERGED_EVENTS[2:]], "received 2 tokens, usage says 3"),
    ([*DIVERGED_EVENTS[:2], chunk("q", finish="length", entries=[{**entry(top("q")), "top_logprobs": []}]),
      *DIVERGED_EVENTS[3:]], "token 2 carries 0 top_logprobs, 5 were asked for"),
    (_with_prompt_tokens(DIVERGED_EVENTS, 6), "prompt_tokens 6, the reference's 5"),
])
def test_top5_still_checks_the_protocol_after_a_divergence(events: list, problem: str) -> None:
    result = serve_top5(events)
    assert any(problem in p for p in result.problems), result.problems
    assert summarize([result], 1.0, None, None)["wrong_answers"] == 1
    assert divergences([result])["diverged_within_top5"] == 0


def test_top5_over_the_sdk_collects_the_same_tokens() -> None:
    """The SDK path parses chunks into its own types; top_logprobs must survive model_dump."""
    body = sse(top5_events(DIVERGED))

    async def go() -> Result:
        transport = httpx.MockTransport(
            lambda request: httpx.Response(200, text=body, headers={"content-type": "text/event-stream"}))
        async with openai.AsyncOpenAI(base_url="http://fake/v1", api_key="k", max_retries=0,
                                      http_client=httpx.AsyncClient(transport=transport)) as sdk:
            return await sdk_request(sdk, TARGET, PROMPT, TOP5_REFERENCE, None, "top5")

    result = asyncio.run(go())
    assert result.via == "sdk" and result.problems == [] and result.divergence == Divergence(1, "B", "b")


def _reference(match: Match, top_logprobs: int = 5) -> Answer:
    content = [{**entry(t), "top_logprobs": entry(t)["top_logprobs"][:top_logprobs]} for t in SAME]
    body = {"id": "c1", "object": "chat.completion", "created": 0, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "abc"},
                         "logprobs": {"content": content}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}

    async def go() -> Answer:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, json=body))
        async with openai.AsyncOpenAI(base_url="http://fake/v1", api_key="k", max_retries=0,
                                      http_client=httpx.AsyncClient(transport=transport)) as sdk:
            return await fetch_reference(sdk, TARGET, PROMPT, match)

    return asyncio.run(go())


def test_the_reference_keeps_each_tokens_top5_only_under_top5() -> None:
    assert _reference("top5").tokens == TOP5_REFERENCE.tokens
    assert _reference("exact") == REFERENCE and _reference("exact").tokens == ()
    with pytest.raises(RuntimeError, match="without 5 top_logprobs"):
        _reference("top5", top_logprobs=4)
