"""OpenAI-shaped errors: every failure is rendered as {"error": {message, type, param, code}}.

FastAPI's 422 becomes 400 and nothing escapes as a bare 500: handlers below map every
exception the app can raise onto a status a client can act on.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

log = logging.getLogger("moe_serve")
CLIENT_CLOSED_REQUEST = 499  # nginx's code: the client is gone, nobody reads this status

# OpenAI fields this server deliberately does not implement: named in the 400 as unsupported
# rather than unknown, so a client learns the feature is missing, not misspelt.
UNSUPPORTED_FIELDS = frozenset({
    "functions", "function_call",  # the deprecated spelling of tools / tool_choice
    "echo", "suffix", "best_of", "audio", "modalities", "prediction",
    "web_search_options", "verbosity",
    "prompt_cache_key", "safety_identifier",
    "include",  # the Responses API's extras (reasoning.encrypted_content, logprobs, ...): none are issued
})
# pydantic's names for union members, which appear in error locations but are not fields
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


@dataclass
class APIError(Exception):
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def unknown_model(model: str, served: str) -> APIError:
    return APIError(404, f"the model '{model}' does not exist; this server serves '{served}'", param="model",
                    code="model_not_found")


def engine_unavailable(message: str = "the engine is not ready (starting or restarting); retry shortly") -> APIError:
    return APIError(503, message, type="server_error", code="engine_unavailable", headers={"Retry-After": "1"})


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def validation_error(errors: list[dict]) -> APIError:
    """The first pydantic complaint, with the offending field named as OpenAI does in `param`."""
    first = errors[0]
    loc = _field_path(first.get("loc", ()))
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request(f"malformed JSON body: {first.get('msg', '')}", code="invalid_json")
    if kind == "extra_forbidden":
        name = loc[-1] if loc else "?"
        if name in UNSUPPORTED_FIELDS:
            return bad_request(f"'{param}' is not supported by this server", param, "unsupported_parameter")
        return bad_request(f"unknown field '{param}'", param, "unknown_parameter")
    if kind == "missing":
        return bad_request(f"missing required field '{param}'", param, "missing_required_parameter")
    return bad_request(f"invalid value for '{param}': {first.get('msg', '')}", param)


def _field_path(loc: tuple) -> list[str]:
    """loc without FastAPI's "body" and pydantic's union-member tags ("str", "list[int]", "TextPart")."""
    path = []
    for part in loc:
        if isinstance(part, int) or (part != "body" and part.isidentifier() and part.islower()
                                     and part not in _TYPE_TAGS):
            path.append(str(part))
    return path


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404 else None)
        return error_response(err)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, exc: ClientDisconnect) -> Response:
        # The client hung up before its body arrived: nothing to answer, and no server error to log.
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A bug, logged with its traceback; the client gets a retryable server error, not a bare 500.
        log.exception("unhandled error: %s", exc)
        return error_response(APIError(503, f"internal error: {type(exc).__name__}", type="server_error",
                                       code="internal_error"))
