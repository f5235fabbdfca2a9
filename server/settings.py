"""Server-side settings (the engine's are engine.config.EngineConfig); fixed at start-up."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_queue: int = 64  # engine requests (waiting + running) before new ones get 429
    max_tokens_cap: int | None = None  # upper bound on max_tokens per request; None: max_model_len
    metrics_require_key: bool = False
    max_body_bytes: int = 4 * 1024 * 1024
    # On SIGTERM requests in flight get this long to finish before they end with a 503 (an error
    # event in a stream); uvicorn's graceful timeout and the SSE grace period are set above it.
    drain_seconds: float = 3.0

    @property
    def stream_grace_seconds(self) -> float:
        """How long a stream stays open once uvicorn is told to exit: past the drain."""
        return self.drain_seconds + 1.0

    @property
    def graceful_shutdown_seconds(self) -> float:
        return self.drain_seconds + 2.0

    def describe(self) -> dict:
        """Everything but the API key, for the start-up log."""
        return {"served_model_name": self.served_model_name, "host": self.host, "port": self.port,
                "api_key": "set" if self.api_key else "none", "max_queue": self.max_queue,
                "max_tokens_cap": self.max_tokens_cap, "metrics_require_key": self.metrics_require_key,
                "max_body_bytes": self.max_body_bytes,
                "drain_seconds": self.drain_seconds}
