"""POST /tokenize and /detokenize with vLLM's bodies: the served tokenizer, no engine step.

A chat body is rendered exactly as /v1/chat/completions renders it (moe_serve/server/prompts.py), so its
count is the prompt_tokens a chat completion of the same messages reports.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from moe_serve.engine.messages import EngineReady
from moe_serve.server.errors import bad_request, engine_unavailable, unknown_model, validation_error
from moe_serve.server.prompts import chat_prompts
from moe_serve.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from moe_serve.server.state import AppState, require_api_key

router = APIRouter()


@router.post("/tokenize")
async def tokenize(request: Request) -> JSONResponse:
    state = await require_api_key(request)
    data = _json_object(await request.body())
    body = _validated(TokenizeChatRequest if "messages" in data else TokenizeCompletionRequest, data)
    engine = _engine(state, body.model)
    if isinstance(body, TokenizeChatRequest):
        body.check()
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()] or None  # as chat renders them
        # a long prompt: off the loop
        [ids] = await asyncio.to_thread(chat_prompts, body, state.tokenizer, tools, state.harmony)
    else:
        ids = await asyncio.to_thread(state.tokenizer.encode, body.prompt, body.add_special_tokens)
    strs = [state.tokenizer.token_text(t) for t in ids] if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                         "token_strs": strs})


@router.post("/detokenize")
async def detokenize(request: Request) -> JSONResponse:
    state = await require_api_key(request)
    body = _validated(DetokenizeRequest, _json_object(await request.body()))
    vocab_size = _engine(state, body.model).vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "tokens")
    return JSONResponse({"prompt": state.tokenizer.decode(body.tokens, skip_special_tokens=False)})


def _json_object(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"malformed JSON body: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return data


def _validated(model: type[BaseModel], data: dict) -> BaseModel:
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc.errors()) from None


def _engine(state: AppState, model: str | None) -> EngineReady:
    """404 for a model this server does not serve (model is optional here, as in vLLM); 503 while loading."""
    if model is not None and model != state.settings.served_model_name:
        raise unknown_model(model, state.settings.served_model_name)
    if state.engine.ready is None:
        raise engine_unavailable()
    return state.engine.ready
