"""POST /v1/chat/completions and /v1/completions: parse at the edge, plan, serve."""
from __future__ import annotations

import asyncio
import logging
from typing import TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import ValidationError

from engine.messages import EngineReady
from server.errors import APIError, bad_request, engine_unavailable, validation_error
from server.prompts import chat_prompts, completion_prompts, make_plan
from server.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from server.responses import ChatFormat, CompletionFormat, ResponseFormat
from server.serving import Envelope, Generation, respond_json, respond_stream
from server.state import AppState, require_api_key

log = logging.getLogger("moe_serve")
router = APIRouter()
Body = TypeVar("Body", bound=GenerationFields)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = await require_api_key(request)
    body = await _parse(request, ChatCompletionRequest)
    engine = _checked(state, body)
    _check_fits(body.n or 1, state.settings.max_queue, "n")
    # Templating and tokenising a long prompt take seconds (a 4 MiB one: ~4 s here); on a worker thread
    # the event loop keeps streaming everyone else's tokens meanwhile (the Rust tokenizer drops the GIL).
    prompts = await asyncio.to_thread(chat_prompts, body, state.tokenizer)
    fmt = ChatFormat(state.tokenizer.token_text, bool(body.logprobs))
    return await _serve(request, state, body, prompts, fmt, body.engine_logprobs(), engine)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = await require_api_key(request)
    body = await _parse(request, CompletionRequest)
    engine = _checked(state, body)
    _check_fits(len(body.prompts()) * (body.n or 1), state.settings.max_queue, "prompt")
    prompts = await asyncio.to_thread(completion_prompts, body, state.tokenizer, engine.vocab_size)  # as above
    fmt = CompletionFormat(state.tokenizer.token_text, body.logprobs is not None)
    return await _serve(request, state, body, prompts, fmt, body.engine_logprobs(), engine)


async def _parse(request: Request, model: type[Body]) -> Body:
    """JSON whatever the Content-Type says (curl -d sends form-encoded); 400 on anything malformed."""
    try:
        body = model.model_validate_json(await request.body())
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None
    body.check()
    return body


def _check_fits(choices: int, max_queue: int, param: str) -> None:
    """Checked before tokenising: a 4 MiB list of prompts would hold the event loop for tens of seconds,
    and more choices than the engine queue holds can never be admitted (a 400, not a 429 to retry)."""
    if choices > max_queue:
        raise bad_request(f"this request asks for {choices} choices (prompts x n); this server runs at most "
                          f"{max_queue} at once", param)


def _checked(state: AppState, body: GenerationFields) -> EngineReady:
    if body.model != state.settings.served_model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves "
                       f"'{state.settings.served_model_name}'", param="model", code="model_not_found")
    ready = state.engine.ready
    if ready is None:
        raise engine_unavailable()
    return ready


async def _serve(request: Request, state: AppState, body: GenerationFields, prompts: list[list[int]],
                 fmt: ResponseFormat, logprobs: int | None, engine: EngineReady) -> Response:
    env = Envelope.new(fmt, state.settings.served_model_name)
    plan = make_plan(body, prompts, env.id, engine, state.tokenizer.eos_token_ids,
                     state.settings.max_tokens_cap, logprobs)
    log.info("%s: %d prompt tokens, %d choices%s", env.id, plan.prompt_tokens, len(plan.requests),
             f", user {body.user!r}" if body.user else "")
    gen = Generation(plan, state.engine, state.metrics, state.tokenizer, body.stop_strings(),
                     state.settings.max_queue)
    if body.stream:
        return respond_stream(gen, env, body.include_usage(), state.settings.stream_grace_seconds)
    return await respond_json(request, gen, env)
