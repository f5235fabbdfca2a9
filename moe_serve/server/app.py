"""The FastAPI app: lifespan (engine process up/down), middleware (body limit, CORS), /health,
/v1/models, /version, /metrics, and the 404 that names an unknown route."""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from moe_serve.engine.channel import channel_addresses
from moe_serve.engine.cli import package_version
from moe_serve.engine.config import EngineConfig
from moe_serve.server.engine_client import EngineClient, EngineSupervisor, InFlightCounts, SharedEngine
from moe_serve.server.errors import APIError, error_response, install_error_handlers, unknown_model
from moe_serve.server.harmony import Harmony, load_encoding
from moe_serve.server.metrics import ServerMetrics
from moe_serve.server.responses_api import ResponseStore
from moe_serve.server.responses_api import router as responses_router
from moe_serve.server.routes import router
from moe_serve.server.settings import ServerSettings
from moe_serve.server.state import AppState, app_state, require_api_key
from moe_serve.server.tokenize_routes import router as tokenize_router
from moe_serve.server.tokenizer import Tokenizer

log = logging.getLogger("moe_serve")
PACKAGE_VERSION = package_version()


def create_app(settings: ServerSettings, engine_config: EngineConfig, on_fatal: Callable[[], None] = lambda: None,
               shared: SharedEngine | None = None) -> FastAPI:
    """on_fatal is called (on the event loop) if the engine cannot start at all; the CLI stops uvicorn.
    shared: this is one of --api-server-count's processes, and the engine is its parent's; None: this
    process runs the engine itself."""
    metrics = ServerMetrics(settings.served_model_name)
    addresses = channel_addresses(1) if shared is None else (shared.channel,)
    in_flight = InFlightCounts.private() if shared is None else shared.in_flight
    engine = EngineClient(addresses[0], in_flight, metrics.on_snapshot, metrics.engine.engine_lost, on_fatal)
    supervisor = EngineSupervisor(engine_config, addresses) if shared is None else None
    tokenizer = Tokenizer(engine_config.model, engine_config.trust_remote_code, tokenizer_dir=engine_config.tokenizer,
                          chat_template=settings.chat_template)
    harmony = Harmony(load_encoding()) if settings.harmony else None
    if harmony is not None:
        harmony.check_tokenizer(tokenizer)
    state = AppState(settings, engine, tokenizer, metrics, system_fingerprint(engine_config), harmony)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        if supervisor is not None:
            supervisor.start()
        yield
        await state.engine.close()
        if supervisor is not None:
            await asyncio.to_thread(supervisor.stop)

    # with an API key the interactive docs and schema go too: they would map the API for anyone
    public_docs = settings.api_key is None
    app = FastAPI(title="moe-serve", lifespan=lifespan, docs_url="/docs" if public_docs else None,
                  redoc_url="/redoc" if public_docs else None, openapi_url="/openapi.json" if public_docs else None)
    app.state.moe = state
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    # outermost, so a preflight is answered before the body limit or a route sees it; with no
    # allowed origin it still answers (a 400 naming the origin) instead of a 405
    app.add_middleware(OpenAIShapedCORS, allow_origins=settings.allowed_origins,
                       allow_methods=settings.allowed_methods, allow_headers=settings.allowed_headers)
    install_error_handlers(app)
    app.add_exception_handler(404, unknown_route)
    app.include_router(router)
    app.include_router(tokenize_router)
    app.include_router(responses_router)
    app.state.responses = ResponseStore(settings.response_store_path)
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/v1/models", models, methods=["GET"])
    app.add_api_route("/v1/models/{model_id:path}", model_card, methods=["GET"])
    app.add_api_route("/version", version_endpoint, methods=["GET"])
    app.add_api_route("/metrics", metrics_endpoint, methods=["GET"])
    return app


def system_fingerprint(engine_config: EngineConfig) -> str:
    """OpenAI's system_fingerprint: changes with this package's version or any engine setting, which
    is what can change the output of a seeded request."""
    settings = json.dumps(dataclasses.asdict(engine_config), sort_keys=True, default=str)
    return "fp_" + hashlib.sha256(f"{PACKAGE_VERSION}\n{settings}".encode()).hexdigest()[:12]


async def health(request: Request) -> JSONResponse:
    ready = app_state(request).engine.ready is not None
    return JSONResponse({"status": "ok" if ready else "engine not ready"}, status_code=200 if ready else 503)


async def models(request: Request) -> JSONResponse:
    state = await require_api_key(request)
    return JSONResponse({"object": "list", "data": [_card(state)]})


async def model_card(request: Request, model_id: str) -> JSONResponse:
    state = await require_api_key(request)
    if model_id != state.settings.served_model_name:
        raise unknown_model(model_id, state.settings.served_model_name)
    return JSONResponse(_card(state))


def _card(state: AppState) -> dict:
    card = {"id": state.settings.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "moe-serve"}
    if state.engine.ready is not None:
        card["max_model_len"] = state.engine.ready.max_model_len
    return card


async def version_endpoint(_: Request) -> JSONResponse:
    return JSONResponse({"version": PACKAGE_VERSION})


async def unknown_route(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Starlette's bare "Not Found" names nothing, and clients (langchain) then blame the model."""
    message = f"no route {request.method} {request.url.path}" if exc.detail == "Not Found" else str(exc.detail)
    return error_response(APIError(404, message, code="not_found"))


async def metrics_endpoint(request: Request) -> Response:
    state = app_state(request)
    if state.settings.metrics_require_key:
        await require_api_key(request)
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class OpenAIShapedCORS(CORSMiddleware):
    """Starlette's CORS, with a refused preflight answered in the OpenAI error shape."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code != 400 or not isinstance(response, PlainTextResponse):
            return response
        err = APIError(400, f"CORS preflight refused: {bytes(response.body).decode()} (see --allowed-origins, "
                       "--allowed-methods, --allowed-headers)", code="cors_disallowed")
        headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
        return JSONResponse(err.body(), status_code=400, headers=headers)


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
