"""What the request handlers share: settings, engine client, tokenizer, metrics, harmony; API-key check."""
from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from fastapi import Request

from moe_serve.engine.structured import Grammars
from moe_serve.server.engine_client import EngineClient
from moe_serve.server.errors import APIError
from moe_serve.server.harmony import Harmony
from moe_serve.server.metrics import ServerMetrics
from moe_serve.server.settings import ServerSettings
from moe_serve.server.tokenizer import Tokenizer


@dataclass
class AppState:
    settings: ServerSettings
    engine: EngineClient
    tokenizer: Tokenizer
    metrics: ServerMetrics
    system_fingerprint: str  # every chat and completion body: this build and its engine settings
    harmony: Harmony | None = None  # gpt-oss's harmony format renders chat prompts and reads the answers
    grammars: Grammars = field(init=False)  # checks structured outputs against the served tokenizer

    def __post_init__(self) -> None:
        self.grammars = Grammars(lambda: self.tokenizer.hf)


def app_state(request: Request) -> AppState:
    return request.app.state.moe


async def require_api_key(request: Request) -> AppState:
    """401 unless `Authorization: Bearer <key>` matches (constant-time) or no key is configured."""
    state = app_state(request)
    key = state.settings.api_key
    if key is None:
        return state
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
        raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key")
    return state
