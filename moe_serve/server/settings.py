"""Server-side settings (the engine's are engine.config.EngineConfig); fixed at start-up."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import jinja2

from moe_serve.engine.config import ConfigError


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for a sampling field it leaves unset: OpenAI's defaults, or those the checkpoint's
    generation_config.json states (vLLM's `--generation-config auto`). `do_sample: false` there means greedy
    (transformers' meaning; vLLM ignores do_sample)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def read(cls, source: str, model_dir: str) -> SamplingDefaults:
        """source: auto (the model's folder), vllm (OpenAI's defaults, nothing read) or a folder."""
        if source == "vllm":
            return cls()
        path = Path(model_dir if source == "auto" else source) / "generation_config.json"
        if not path.is_file():
            if source == "auto":
                return cls()
            raise ConfigError(f"--generation-config {source}: no generation_config.json there")
        try:
            data = json.loads(path.read_text())
            values = {f.name: (int if f.name == "top_k" else float)(data[f.name])
                      for f in fields(cls) if data.get(f.name) is not None}
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path}: {exc}") from exc
        if data.get("do_sample") is False:
            values["temperature"] = 0.0
        return cls(**values)

    def describe(self) -> dict:
        """Only what differs from OpenAI's defaults, for the start-up log."""
        return {k: v for k, v in asdict(self).items() if v != getattr(SamplingDefaults, k)}


OPENAI_DEFAULTS = SamplingDefaults()


def read_chat_template(value: str) -> str:
    """--chat-template: a file's text, else the value itself when it looks like Jinja (vLLM's rule);
    a syntax error is reported now rather than on the first chat request."""
    path = Path(value)
    if path.is_file():
        text = path.read_text()
    elif any(mark in value for mark in ("{{", "{%")):
        text = value
    else:
        raise ConfigError(f"--chat-template {value}: no such file, and not a Jinja template either")
    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template: line {exc.lineno}: {exc.message}") from exc
    return text


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
    chat_template: str | None = None  # the template text, replacing the checkpoint's
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    tool_call_parser: str | None = None  # reads tool calls out of tool_choice "auto" answers; None: no "auto"
    reasoning_parser: str | None = None  # splits chat answers' <think> sections off as reasoning_content
    harmony: bool = False  # gpt-oss's harmony format renders chat prompts and reads answers (server/harmony.py)
    # CORS (browsers only): no origin by default, so a web page the user visits cannot call this server
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    log_requests: bool = False  # an INFO line per request (vLLM's --enable-log-requests)
    access_log: bool = True  # uvicorn's line per response
    # the Responses API store: a private database when None, else an SQLite file every API server process shares
    response_store_path: str | None = None

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
                "drain_seconds": self.drain_seconds, "tool_call_parser": self.tool_call_parser,
                "reasoning_parser": self.reasoning_parser, "harmony": self.harmony,
                "chat_template": "given" if self.chat_template else "the checkpoint's",
                "sampling_defaults": self.sampling_defaults.describe(),
                "allowed_origins": self.allowed_origins, "allowed_methods": self.allowed_methods,
                "log_requests": self.log_requests, "access_log": self.access_log,
                "allowed_headers": self.allowed_headers}
