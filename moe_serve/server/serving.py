"""From a Plan to an HTTP response: submit to the engine, decode each choice, answer.

Streamed and non-streamed responses run the same per-choice decoding; they differ only in
when the deltas are written. A stream that falls behind the engine takes what queued up for a
choice as one merged output (moe_serve/server/output_sink.py), so it writes one chunk for many
tokens instead of falling further behind. Whatever ends a response (done, stop string, client
gone, engine died), Generation.close() aborts what the engine is still generating and records
metrics.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from moe_serve.engine.messages import RequestOutput, SamplingParams
from moe_serve.server.choice import ChoiceDecoder, ChoiceDelta, EngineRequestError, TextOptions
from moe_serve.server.engine_client import EngineClient, EngineUnavailable
from moe_serve.server.errors import CLIENT_CLOSED_REQUEST, APIError, engine_unavailable
from moe_serve.server.harmony import Harmony
from moe_serve.server.metrics import ServerMetrics
from moe_serve.server.output_sink import EngineLost, OutputSink
from moe_serve.server.prompts import Plan
from moe_serve.server.reasoning import ReasoningStream
from moe_serve.server.responses import ResponseFormat, usage
from moe_serve.server.tokenizer import Tokenizer
from moe_serve.server.tool_parsers.stream import merge_tool_call_deltas
from moe_serve.server.tool_parsers.tool_choice import ToolCalling

log = logging.getLogger("moe_serve")


@dataclass(frozen=True)
class Envelope:
    """The fields every body and chunk of one response repeats."""

    id: str
    created: int
    model: str
    fmt: ResponseFormat
    system_fingerprint: str

    @classmethod
    def new(cls, fmt: ResponseFormat, model: str, system_fingerprint: str) -> Envelope:
        return cls(f"{fmt.id_prefix}{uuid.uuid4().hex}", int(time.time()), model, fmt, system_fingerprint)

    def body(self, object_name: str, choices: list[dict], **extra: object) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": self.system_fingerprint, "choices": choices, **extra}


class Generation:
    """The engine requests behind one HTTP request, decoded choice by choice."""

    def __init__(self, plan: Plan, engine: EngineClient, metrics: ServerMetrics, tokenizer: Tokenizer,
                 text: TextOptions, max_queue: int, tool_calling: ToolCalling | None = None,
                 reasoning_parser: str | None = None, harmony: Harmony | None = None) -> None:
        """harmony: the answers are in gpt-oss's harmony format, which carries their reasoning and calls."""
        self.plan, self.engine, self.metrics = plan, engine, metrics
        self.choices = {r.request_id: _choice_decoder(i, r.params, tokenizer, text, tool_calling, reasoning_parser,
                                                      harmony)
                        for i, r in enumerate(plan.requests)}
        self.sink = OutputSink()
        self.arrival = time.perf_counter()
        self._first_token_seen = False
        self._failure: str | None = None  # "abort" or "error" once the response ended early
        self._start(max_queue)

    def _start(self, max_queue: int) -> None:
        if self.engine.in_flight + len(self.plan.requests) > max_queue:
            raise APIError(429, f"the server is busy ({self.engine.in_flight} requests in flight, "
                           f"at most {max_queue}); retry shortly", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"})
        try:
            self.engine.submit(self.plan.requests, self.sink)
        except EngineUnavailable:
            raise engine_unavailable() from None
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_ids) for r in self.plan.requests))

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices.values())

    @property
    def reasoning_tokens(self) -> int:
        return sum(c.reasoning_tokens for c in self.choices.values())

    def usage(self) -> dict:
        return usage(self.plan.prompt_tokens, self.completion_tokens, self.reasoning_tokens)

    async def deltas(self) -> AsyncIterator[ChoiceDelta]:
        """Each choice's deltas as the engine produces them, until every choice has finished: one
        delta per choice for whatever arrived since the last look."""
        while any(c.finish_reason is None for c in self.choices.values()):
            for item in await self.sink.take():
                if isinstance(item, EngineLost):
                    self._failure = "error"
                    raise engine_unavailable(item.message)
                if self.choices[item.request_id].finish_reason is None:  # not already ended by a stop string
                    yield self._consume(item)

    def _consume(self, output: RequestOutput) -> ChoiceDelta:
        choice = self.choices[output.request_id]
        try:
            delta = choice.consume(output)
        except EngineRequestError as exc:
            self._failure = "error"
            raise APIError(503, f"the engine failed this request: {exc}", type="server_error",
                           code="engine_error") from exc
        if output.new_token_ids and not self._first_token_seen:
            self._first_token_seen = True
            self.metrics.ttft.observe(time.perf_counter() - self.arrival)
        if delta.finish_reason is not None and output.finish_reason is None:
            self.engine.abort([output.request_id])  # a stop string ended it: free the engine now
        return delta

    def close(self) -> None:
        """Abort what is unfinished (client gone, error) and record the request in metrics."""
        unfinished = [rid for rid, c in self.choices.items() if c.finish_reason is None]
        self.engine.abort(unfinished)
        for choice in self.choices.values():
            reason = choice.finish_reason or self._failure or "abort"
            self.metrics.requests[reason if reason in ("stop", "length", "error") else "abort"].inc()
        self.metrics.generation_tokens.inc(self.completion_tokens)
        if not unfinished:
            self.metrics.e2e.observe(time.perf_counter() - self.arrival)


def _choice_decoder(index: int, params: SamplingParams, tokenizer: Tokenizer, text: TextOptions,
                    tool_calling: ToolCalling | None, reasoning_parser: str | None,
                    harmony: Harmony | None) -> ChoiceDecoder:
    if harmony is not None:
        stream = harmony.stream(tool_calling is not None, tool_calling.max_calls if tool_calling else None)
        return ChoiceDecoder(index, tokenizer, text, params, harmony=stream)
    return ChoiceDecoder(index, tokenizer, text, params, tool_calling.stream() if tool_calling else None,
                         ReasoningStream(reasoning_parser) if reasoning_parser else None)


async def respond_json(request: Request, gen: Generation, env: Envelope) -> Response:
    """Non-streamed: gather every choice; abort if the client disconnects while we wait."""
    choices = await collect(request, gen)
    if choices is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    body = env.body(env.fmt.object_name, [env.fmt.choice(c) for c in choices], usage=gen.usage(),
                    **env.fmt.response_fields(choices))
    return JSONResponse(body)


async def collect(request: Request, gen: Generation) -> list[ChoiceDelta] | None:
    """Every choice whole; None if the client disconnected first (what was unfinished is aborted).
    Raises the APIError that ended the generation, if any, for the error handler."""
    collected = asyncio.ensure_future(_collect(gen))
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({collected, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collected.done():
            collected.cancel()
        gen.close()
    if not collected.done() or collected.cancelled():
        return None
    return collected.result()


async def _collect(gen: Generation) -> list[ChoiceDelta]:
    merged = [ChoiceDelta(c.index) for c in gen.choices.values()]
    async for delta in gen.deltas():
        whole = merged[delta.index]
        whole.text += delta.text
        whole.logprobs.extend(delta.logprobs)
        whole.prompt_logprobs.extend(delta.prompt_logprobs)
        merge_tool_call_deltas(whole.tool_calls, delta.tool_calls)
        whole.reasoning += delta.reasoning
        whole.finish_reason = delta.finish_reason or whole.finish_reason
    return merged


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def respond_stream(gen: Generation, env: Envelope, include_usage: bool, grace_seconds: float) -> EventSourceResponse:
    """grace_seconds: sse-starlette cuts every stream the moment uvicorn is told to exit; this keeps
    them open while the server drains, so each ends with its last chunk or an error event."""
    return EventSourceResponse(_events(gen, env, include_usage), sep="\n", shutdown_grace_period=grace_seconds)


async def _events(gen: Generation, env: Envelope, include_usage: bool) -> AsyncIterator[dict]:
    """SSE events: chunks (the first of each choice carries the role), usage, then [DONE].

    Cancelled when the client disconnects; the finally clause then aborts the engine requests.
    """
    extra = {"usage": None} if include_usage else {}
    started: set[int] = set()
    try:
        async for delta in gen.deltas():
            first = delta.index not in started
            started.add(delta.index)
            if first or delta.text or delta.reasoning or delta.logprobs or delta.tool_calls or delta.finish_reason:
                choice = env.fmt.chunk_choice(delta, first)
                yield _event(env.body(env.fmt.chunk_object_name, [choice], **extra))
        if include_usage:
            yield _event(env.body(env.fmt.chunk_object_name, [], usage=gen.usage()))
    except APIError as err:
        log.warning("stream %s ended with an error: %s", env.id, err.message)
        yield _event(err.body())
    finally:
        gen.close()
    yield {"data": "[DONE]"}


def _event(body: dict) -> dict:
    return {"data": json.dumps(body, ensure_ascii=False, separators=(",", ":"))}
