"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API served on the chat path.

A Responses body becomes a chat completion body (instructions as the system message, input
items as messages, function_call / function_call_output items as assistant tool calls and tool
turns, a reasoning item as the reasoning_content of the assistant turn it opens, text.format as
response_format, function tools as chat tools), so templating, validation, sampling, structured
outputs, tool calling and reasoning are the chat path's own; only the answer's shape differs (a reasoning item for its reasoning_content, a message item for its text, a
function_call item per call; reasoning.effort is the chat path's reasoning_effort). With store
(OpenAI's default) a bounded number of responses is kept (in SQLite, shared by the API server
processes), for GET and for previous_response_id, which continues that response's conversation
(its instructions are not carried over, as OpenAI documents).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from itertools import count
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from sse_starlette import EventSourceResponse

from moe_serve.server.errors import CLIENT_CLOSED_REQUEST, APIError, bad_request, validation_error
from moe_serve.server.prompts import chat_prompts
from moe_serve.server.protocol import ChatCompletionRequest, ResponsesRequest
from moe_serve.server.response_store import ResponseStore, StoredResponse
from moe_serve.server.routes import checked_engine, start_generation
from moe_serve.server.serving import Generation, collect
from moe_serve.server.state import require_api_key
from moe_serve.server.tool_parsers.stream import ToolCallDelta
from moe_serve.server.tool_parsers.tool_choice import tool_calling

router = APIRouter()

Event = tuple[str, dict]  # (type, fields) of one stream event


class OutputItems:
    """An answer's output items in the order they appear (its reasoning, its text message, its function
    calls), and the stream events that open, grow and close them."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._positions: dict[str, int] = {}  # item id -> output_index
        self._texts: dict[str, dict] = {}  # "message" / "reasoning" -> that item, once opened
        self._calls: dict[int, dict] = {}  # the chat path's tool call index -> its function_call item

    def add_text(self, text: str) -> list[Event]:
        return self._add_to("message", text)

    def add_reasoning(self, text: str) -> list[Event]:
        """The chat path's reasoning_content (the harmony format's analysis channel) as a reasoning item."""
        return self._add_to("reasoning", text)

    def _add_to(self, kind: str, text: str) -> list[Event]:
        events = []
        item = self._texts.get(kind)
        if item is None:
            item = self._texts[kind] = self._open(_text_item(kind))
            events += [("response.output_item.added", {"output_index": self._positions[item["id"]],
                                                       "item": item | {"content": []}}),
                       ("response.content_part.added", {**self._where(item), "part": _text_part(kind, "")})]
        item["content"][0]["text"] += text
        if text:
            events.append((f"{_TEXT_EVENTS[kind]}.delta", {**self._where(item), "delta": text, **_logprobs(kind)}))
        return events

    def add_call(self, delta: ToolCallDelta) -> list[Event]:
        events = []
        item = self._calls.get(delta.index)
        if item is None:
            item = self._calls[delta.index] = self._open({
                "id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": delta.id or f"call_{uuid.uuid4().hex}", "name": delta.name or "", "arguments": ""})
            events.append(("response.output_item.added",
                           {"output_index": self._positions[item["id"]], "item": dict(item)}))
        item["arguments"] += delta.arguments
        if delta.arguments:
            events.append(("response.function_call_arguments.delta", {
                "item_id": item["id"], "output_index": self._positions[item["id"]], "delta": delta.arguments}))
        return events

    def close(self, status: str) -> list[Event]:
        """Every item done (an answer with none gets an empty message)."""
        events = [] if self.items else self.add_text("")
        for index, item in enumerate(self.items):
            kind = item["type"]
            item["status"] = status if kind in _TEXT_EVENTS else "completed"
            if kind in _TEXT_EVENTS:
                text = item["content"][0]["text"]
                events += [(f"{_TEXT_EVENTS[kind]}.done", {**self._where(item), "text": text, **_logprobs(kind)}),
                           ("response.content_part.done", {**self._where(item), "part": _text_part(kind, text)})]
            else:
                events.append(("response.function_call_arguments.done",
                               {"item_id": item["id"], "output_index": index, "arguments": item["arguments"]}))
            events.append(("response.output_item.done", {"output_index": index, "item": item}))
        return events

    def as_chat_message(self) -> dict[str, Any]:
        """The answer as the assistant turn a later previous_response_id continues from."""
        calls = [{"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                 for c in self.items if c["type"] == "function_call"]
        text, reasoning = (self._texts[kind]["content"][0]["text"] if kind in self._texts else None
                           for kind in ("message", "reasoning"))
        return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {}),
                **({"reasoning_content": reasoning} if reasoning is not None else {})}

    def _open(self, item: dict) -> dict:
        self._positions[item["id"]] = len(self.items)
        self.items.append(item)
        return item

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self._positions[item["id"]], "content_index": 0}


@dataclass
class ResponseDraft:
    """One response being answered: the fields every rendering of it repeats."""

    id: str
    created_at: int
    model: str
    body: ResponsesRequest
    conversation: list[dict[str, Any]]  # the chat messages sent, without the instructions

    def render(self, status: str, output: list[dict] | None = None, usage: dict | None = None) -> dict:
        b = self.body
        fmt = b.text.format if b.text is not None and b.text.format is not None else None
        choice = b.tool_choice.model_dump() if isinstance(b.tool_choice, BaseModel) else b.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.model,
            "output": output or [], "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": b.reasoning.effort if b.reasoning is not None else None, "summary": None},
            "store": b.store is not False, "temperature": b.temperature, "top_p": b.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": choice or "auto", "tools": b.tools or [], "truncation": "disabled", "usage": usage,
            "user": b.user, "metadata": b.metadata or {},
        }


# the items that hold text: the prefix of their text's stream events
_TEXT_EVENTS = {"message": "response.output_text", "reasoning": "response.reasoning_text"}


def _text_item(kind: str) -> dict:
    if kind == "message":
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "status": "in_progress", "role": "assistant",
                "content": [_text_part(kind, "")]}
    return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress", "summary": [],
            "content": [_text_part(kind, "")]}


def _text_part(kind: str, text: str) -> dict:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "reasoning_text", "text": text}


def _logprobs(kind: str) -> dict:
    """An answer's text events carry its logprobs (none asked for here); reasoning's carry none."""
    return {"logprobs": []} if kind == "message" else {}


def responses_usage(gen: Generation) -> dict:
    input_tokens, output_tokens = gen.plan.prompt_tokens, gen.completion_tokens
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": gen.reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


@router.post("/v1/responses")
async def create_response(request: Request) -> Response:
    state = await require_api_key(request)
    try:
        body = ResponsesRequest.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    body.check()
    store: ResponseStore = request.app.state.responses
    earlier = () if body.previous_response_id is None else \
        store.get(body.previous_response_id, "previous_response_id").conversation
    draft = ResponseDraft(f"resp_{uuid.uuid4().hex}", int(time.time()), state.settings.served_model_name, body,
                          [*earlier, *body.messages()])
    if body.reasoning is not None and state.harmony is None:
        raise bad_request("reasoning.effort is served with the harmony format (gpt-oss) only", "reasoning.effort")
    chat = _as_chat(body, draft.conversation)
    engine = checked_engine(state, chat)
    # the tool schemas compile and a long prompt is templated off the event loop, as on the chat path
    tools = await asyncio.to_thread(tool_calling, chat, state.settings.tool_call_parser, state.grammars,
                                    state.harmony is not None)
    prompts = await asyncio.to_thread(chat_prompts, chat, state.tokenizer, tools and tools.template_tools,
                                      state.harmony)
    gen = await start_generation(state, chat, prompts, draft.id, None, engine, tools, state.settings.reasoning_parser,
                                 state.harmony)
    if body.stream:
        return EventSourceResponse(_events(gen, draft, store), sep="\n",
                                   shutdown_grace_period=state.settings.stream_grace_seconds)
    choices = await collect(request, gen)
    if choices is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    items, [whole] = OutputItems(), choices
    if whole.reasoning:
        items.add_reasoning(whole.reasoning)
    if whole.text:
        items.add_text(whole.text)
    for call in whole.tool_calls:
        items.add_call(call)
    return JSONResponse(_finish(gen, draft, items, whole.finish_reason, store)[1])


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> JSONResponse:
    await require_api_key(request)
    store: ResponseStore = request.app.state.responses
    return JSONResponse(store.get(response_id, "response_id").body)


def _as_chat(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion body this response is served as."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    fmt = body.text.format if body.text is not None else None
    chat = {"model": body.model, "messages": [*system, *conversation], "max_completion_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "user": body.user,
            "response_format": fmt.response_format() if fmt is not None else None,
            "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None, **body.chat_tools()}
    try:
        chat_body = ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    chat_body.check()
    return chat_body


def _finish(gen: Generation, draft: ResponseDraft, items: OutputItems, finish_reason: str | None,
            store: ResponseStore) -> tuple[list[Event], dict]:
    """The closing events and the final response object, stored unless store is false."""
    status = "incomplete" if finish_reason == "length" else "completed"
    events = items.close(status)
    body = draft.render(status, items.items, responses_usage(gen))
    if draft.body.store is not False:
        store.put(StoredResponse(body, (*draft.conversation, items.as_chat_message())))
    return events, body


async def _events(gen: Generation, draft: ResponseDraft, store: ResponseStore) -> AsyncIterator[dict]:
    """OpenAI's event sequence: created, in_progress, then per output item (the text message, each
    function call) its opening, deltas and closing, then the response completed (or incomplete)."""
    numbers = count()

    def event(kind: str, fields: dict) -> dict:
        data = {"type": kind, "sequence_number": next(numbers), **fields}
        return {"event": kind, "data": json.dumps(data, ensure_ascii=False, separators=(",", ":"))}

    items, finish_reason = OutputItems(), None
    try:
        yield event("response.created", {"response": draft.render("in_progress")})
        yield event("response.in_progress", {"response": draft.render("in_progress")})
        async for delta in gen.deltas():
            finish_reason = delta.finish_reason or finish_reason
            for kind, fields in [*(items.add_reasoning(delta.reasoning) if delta.reasoning else []),
                                 *(items.add_text(delta.text) if delta.text else []),
                                 *(e for call in delta.tool_calls for e in items.add_call(call))]:
                yield event(kind, fields)
        closing, final = _finish(gen, draft, items, finish_reason, store)
        for kind, fields in closing:
            yield event(kind, fields)
        yield event(f"response.{final['status']}", {"response": final})
    except APIError as err:
        yield event("error", {"code": err.code, "message": err.message, "param": err.param})
    finally:
        gen.close()
