"""moe-serve: flags (optionally from a YAML --config), start-up log, then uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import uvicorn
import yaml

from engine.cli import add_engine_arguments, engine_config_from_args
from server.engine_client import EngineClient
from server.settings import ServerSettings

log = logging.getLogger("moe_serve")
# Idle keep-alive connections are closed after this long. It must outlast the clients' own idle
# expiry (httpx, so the OpenAI SDK: 5 s): at uvicorn's 5 s both ends expire together, and a request
# sent on the connection just as the server closes it fails with a ReadError without reaching the app.
KEEP_ALIVE_SECONDS = 10


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-serve", description="OpenAI-compatible server for MoE models.")
    parser.add_argument("--config", metavar="FILE",
                        help="YAML of flag values (keys are flag names without '--'); command-line flags win")
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model's folder)")
    parser.add_argument("--api-key", default=os.environ.get("MOE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $MOE_API_KEY; unset = open)")
    parser.add_argument("--max-queue", type=_positive_int, default=64,
                        help="engine requests in flight before new ones get 429")
    parser.add_argument("--max-tokens-cap", type=_positive_int, default=None,
                        help="largest max_tokens a request may ask for (default: what the context allows)")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=4 * 1024 * 1024,
                        help="larger request bodies get 413")
    parser.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    parser.add_argument("--drain-seconds", type=float, default=ServerSettings.drain_seconds,
                        help="on SIGTERM, how long requests in flight get to finish before they end with a 503")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    config_file = pre.parse_known_args(argv)[0].config
    if config_file is not None:
        argv = config_argv(Path(config_file), parser) + argv  # later flags override earlier ones
    return parser.parse_args(argv)


def config_argv(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    """A YAML mapping as the flags it stands for, so argparse checks types and choices once."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as exc:
        parser.error(f"--config {path}: {exc}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of flag names to values")
    actions = {opt[2:]: a for a in parser._actions for opt in a.option_strings if opt.startswith("--")}
    argv: list[str] = []
    for key, value in data.items():
        action = actions.get(str(key))
        if action is None or key in ("config", "help"):
            parser.error(f"--config {path}: unknown key '{key}' (keys are moe-serve flag names without '--')")
        if value is None:
            continue
        if action.nargs == 0:  # a switch such as --trust-remote-code
            if not isinstance(value, bool):
                parser.error(f"--config {path}: '{key}' is a switch; use true or false")
            argv += [f"--{key}"] if value else []
        else:
            argv += [f"--{key}", _flag_value(value)]
    return argv


def _flag_value(value: object) -> str:
    """YAML 1.1 reads on/off/yes/no as booleans; give flags such as --cuda-graphs their word back."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def server_settings_from_args(args: argparse.Namespace) -> ServerSettings:
    return ServerSettings(
        served_model_name=args.served_model_name or Path(args.model).name, host=args.host, port=args.port,
        api_key=args.api_key or None, max_queue=args.max_queue, max_tokens_cap=args.max_tokens_cap,
        metrics_require_key=args.metrics_require_key, max_body_bytes=args.max_body_bytes,
        drain_seconds=args.drain_seconds,
    )


class DrainingServer(uvicorn.Server):
    """uvicorn whose shutdown (it stops accepting first) gives requests in flight `drain_seconds`,
    then fails the rest with a 503 instead of cutting their connections mid-response."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, drain_seconds: float) -> None:
        super().__init__(config)
        self.engine, self.drain_seconds = engine, drain_seconds

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        drain = asyncio.get_running_loop().call_later(
            self.drain_seconds, self.engine.fail_in_flight, "the server is shutting down; retry the request")
        try:
            await super().shutdown(sockets)
        finally:
            drain.cancel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not Path(args.model).is_dir():
        sys.exit(f"moe-serve: --model {args.model}: no such checkpoint directory")
    from server.app import create_app  # after the checks: importing it pulls in transformers

    engine_config = engine_config_from_args(args)
    settings = server_settings_from_args(args)
    log.info("server settings: %s", settings.describe())
    log.info("engine settings: %s", dataclasses.asdict(engine_config))

    def stop() -> None:
        server.should_exit = True

    app = create_app(settings, engine_config, on_fatal=stop)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info",
                            timeout_graceful_shutdown=settings.graceful_shutdown_seconds,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS)
    server = DrainingServer(config, app.state.moe.engine, settings.drain_seconds)
    log.info("OpenAI API at http://%s:%d/v1, Prometheus metrics at http://%s:%d/metrics", settings.host,
             settings.port, settings.host, settings.port)
    # uvicorn re-raises a SIGTERM it handled once its graceful shutdown is done, which would make a
    # clean stop exit -15; set just before run(), this handler only ever sees that re-raise.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    fatal = app.state.moe.engine.fatal_error
    if fatal is not None:
        log.error("the engine could not start: %s", fatal)
        return 1
    return 0
