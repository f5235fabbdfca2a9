"""The FastAPI app: lifespan (engine process up/down), middleware, /health, /v1/models, /metrics."""
from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.config import EngineConfig
from server.engine_client import EngineClient
from server.errors import APIError, error_response, install_error_handlers
from server.metrics import ServerMetrics
from server.routes import router
from server.settings import ServerSettings
from server.state import AppState, app_state, require_api_key
from server.tokenizer import Tokenizer

log = logging.getLogger("moe_serve")


def create_app(settings: ServerSettings, engine_config: EngineConfig,
               on_fatal: Callable[[], None] = lambda: None) -> FastAPI:
    """on_fatal is called (on the event loop) if the engine cannot start at all; the CLI stops uvicorn."""
    metrics = ServerMetrics()
    engine = EngineClient(engine_config, metrics.on_snapshot, metrics.engine.engine_lost, on_fatal)
    state = AppState(settings, engine, Tokenizer(engine_config.model, engine_config.trust_remote_code), metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await state.engine.close()

    # with an API key the interactive docs and schema go too: they would map the API for anyone
    public_docs = settings.api_key is None
    app = FastAPI(title="moe-serve", lifespan=lifespan, docs_url="/docs" if public_docs else None,
                  redoc_url="/redoc" if public_docs else None, openapi_url="/openapi.json" if public_docs else None)
    app.state.moe = state
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    install_error_handlers(app)
    app.include_router(router)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"])
    return app


async def health(request: Request) -> JSONResponse:
    ready = app_state(request).engine.ready is not None
    return JSONResponse({"status": "ok" if ready else "engine not ready"}, status_code=200 if ready else 503)


async def models(request: Request) -> JSONResponse:
    state = await require_api_key(request)
    ready = state.engine.ready
    card = {"id": state.settings.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "moe-serve"}
    if ready is not None:
        card["max_model_len"] = ready.max_model_len
    return JSONResponse({"object": "list", "data": [card]})


async def metrics_endpoint(request: Request) -> Response:
    state = app_state(request)
    if state.settings.metrics_require_key:
        await require_api_key(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class BodyLimit:
    """413 for bodies over the limit: up front from Content-Length, or as a chunked body grows."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await error_response(self._too_large())(scope, receive, send)
            return
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.limit:
                raise self._too_large()  # rendered by the APIError handler
            return message

        await self.app(scope, limited, send)

    def _too_large(self) -> APIError:
        return APIError(413, f"request body exceeds {self.limit} bytes", code="request_too_large")
