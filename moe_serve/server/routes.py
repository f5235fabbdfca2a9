"""POST /v1/chat/completions and /v1/completions: parse at the edge, plan, serve."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from moe_serve.engine.messages import EngineReady
from moe_serve.server.choice import TextOptions
from moe_serve.server.errors import bad_request, engine_unavailable, unknown_model, validation_error
from moe_serve.server.harmony import Harmony, final_answer
from moe_serve.server.prompts import chat_prompts, completion_prompts, make_plan
from moe_serve.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from moe_serve.server.responses import ChatFormat, CompletionFormat, PromptEcho, ResponseFormat
from moe_serve.server.serving import Envelope, Generation, respond_json, respond_stream
from moe_serve.server.state import AppState, require_api_key
from moe_serve.server.structured import checked_structured_output, requested_structured_output
from moe_serve.server.tool_parsers.tool_choice import ToolCalling, tool_calling

log = logging.getLogger("moe_serve")
router = APIRouter()
Body = TypeVar("Body", bound=GenerationFields)
Result = TypeVar("Result")

# A request whose JSON body is at most this big is templated and tokenised on the event loop:
# 0.2-1.2 ms for 0.1-4 KiB of chat text on the CPU machine, where each hop to a worker thread and
# back costs the loop ~60 us idle and more under load (three hops per request made a large share
# of the server's ~2.4 ms of CPU per request). A longer one goes to a worker thread.
INLINE_BODY_BYTES = 4096


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = await require_api_key(request)
    body, size = await _parse(request, ChatCompletionRequest)
    engine = checked_engine(state, body)
    _check_fits(body.n or 1, state.settings.max_queue, "n")
    # a forced tool call's schema compiles against the tokenizer: off the loop
    tools = await _off_loop_if(bool(body.tools), tool_calling, body, state.settings.tool_call_parser, state.grammars,
                               state.harmony is not None)
    prompts = await _off_loop_if(size > INLINE_BODY_BYTES, chat_prompts, body, state.tokenizer,
                                 tools and tools.template_tools, state.harmony)
    fmt = ChatFormat(state.tokenizer.token_text, bool(body.logprobs), body.prompt_logprobs)
    return await _serve(request, state, body, prompts, fmt, body.engine_logprobs(), engine, tools,
                        state.settings.reasoning_parser, state.harmony)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = await require_api_key(request)
    body, size = await _parse(request, CompletionRequest)
    engine = checked_engine(state, body)
    _check_fits(len(body.prompts()) * (body.n or 1), state.settings.max_queue, "prompt")
    prompts = await _off_loop_if(size > INLINE_BODY_BYTES, completion_prompts, body, state.tokenizer, engine.vocab_size)
    echo = PromptEcho([p if isinstance(p, str) else state.tokenizer.decode(p) for p in body.prompts()], prompts,
                      body.n or 1) if body.echo else None
    fmt = CompletionFormat(state.tokenizer.token_text, body.logprobs, echo, body.prompt_logprobs)
    return await _serve(request, state, body, prompts, fmt, body.engine_logprobs(), engine)


async def _parse(request: Request, model: type[Body]) -> tuple[Body, int]:
    """The body and its size in bytes. JSON whatever the Content-Type says (curl -d sends
    form-encoded); 400 on anything malformed."""
    raw = await request.body()
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    body.check()
    return body, len(raw)


async def _off_loop_if(heavy: bool, fn: Callable[..., Result], *args: object) -> Result:
    """fn(*args) on a worker thread when heavy, so the event loop keeps streaming everyone else's
    tokens meanwhile (templating and tokenising a 4 MiB prompt take ~4 s here; the Rust tokenizer
    drops the GIL); else right here, cheaper than the hop."""
    return await asyncio.to_thread(fn, *args) if heavy else fn(*args)


def _check_fits(choices: int, max_queue: int, param: str) -> None:
    """Checked before tokenising: a 4 MiB list of prompts would hold the event loop for tens of seconds,
    and more choices than the engine queue holds can never be admitted (a 400, not a 429 to retry)."""
    if choices > max_queue:
        raise bad_request(f"this request asks for {choices} choices (prompts x n); this server runs at most "
                          f"{max_queue} at once", param)


def checked_engine(state: AppState, body: GenerationFields) -> EngineReady:
    if body.model != state.settings.served_model_name:
        raise unknown_model(body.model, state.settings.served_model_name)
    ready = state.engine.ready
    if ready is None:
        raise engine_unavailable()
    return ready


async def _serve(request: Request, state: AppState, body: GenerationFields, prompts: list[list[int]],
                 fmt: ResponseFormat, logprobs: int | None, engine: EngineReady,
                 tools: ToolCalling | None = None, reasoning_parser: str | None = None,
                 harmony: Harmony | None = None) -> Response:
    env = Envelope.new(fmt, state.settings.served_model_name, state.system_fingerprint)
    gen = await start_generation(state, body, prompts, env.id, logprobs, engine, tools, reasoning_parser, harmony)
    if body.stream:
        return respond_stream(gen, env, body.include_usage(), state.settings.stream_grace_seconds)
    return await respond_json(request, gen, env)


async def start_generation(state: AppState, body: GenerationFields, prompts: list[list[int]], request_id: str,
                           logprobs: int | None, engine: EngineReady, tools: ToolCalling | None = None,
                           reasoning_parser: str | None = None, harmony: Harmony | None = None) -> Generation:
    """Plan a validated body's engine requests and submit them (/v1/responses shares this too).

    tools, reasoning_parser, harmony: chat only; a constrained answer has no reasoning section to split
    off, but in harmony it has (the constraint is written in its markup)."""
    requested = requested_structured_output(body)
    if harmony is not None and requested is not None:
        requested = requested[0], final_answer(requested[1])
    if harmony is not None and body.skip_special_tokens is False:
        raise bad_request("with the harmony format the answer's markup is read into reasoning_content, content "
                          "and tool_calls; there are no special tokens to keep in the text", "skip_special_tokens")
    structured = None if requested is None else await asyncio.to_thread(
        checked_structured_output, *requested, state.grammars)  # compiles: off the loop
    if tools is not None:
        structured = tools.constrain(structured)
    stop_token_ids = state.tokenizer.eos_token_ids + (harmony.stop_token_ids if harmony is not None else ())
    plan = make_plan(body, prompts, request_id, engine, stop_token_ids,
                     state.settings.max_tokens_cap, logprobs, structured, state.settings.sampling_defaults)
    if state.settings.log_requests:
        log.info("%s: %d prompt tokens, %d choices%s", request_id, plan.prompt_tokens, len(plan.requests),
                 f", user {body.user!r}" if body.user else "")
    text = TextOptions(body.stop_strings(), body.skip_special_tokens is not False, bool(body.include_stop_str_in_output))
    return Generation(plan, state.engine, state.metrics, state.tokenizer, text, state.settings.max_queue, tools,
                      reasoning_parser if structured is None else None, harmony)
