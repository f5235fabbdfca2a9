"""Several API servers in one process, each on its own port with its own --tool-call-parser, in front of one
engine process: the tool-call tests drive every parser end to end over HTTP at the cost of one server start-up
(`python -m moe_serve.server` once per parser spent ~9 s each on imports and an engine start on 2 cores).

    python -m tests.server.parser_servers MOE-SERVE-FLAGS [--also-serve PARSER=PORT ...]

The flags' own app listens on their --port; each --also-serve app's settings come from the same flags with
`--tool-call-parser PARSER --port PORT` appended, through the CLI's own parse_args and server_settings_from_args.
The apps share the engine as --api-server-count's processes do (a channel each), on one event loop; a SIGTERM
stops them all."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import uvicorn

from moe_serve.engine.channel import channel_addresses
from moe_serve.engine.cli import engine_config_from_args
from moe_serve.engine.config import EngineConfig
from moe_serve.server.app import create_app
from moe_serve.server.cli import (KEEP_ALIVE_SECONDS, DrainingServer, bind_listener, parse_args,
                                  server_settings_from_args)
from moe_serve.server.engine_client import EngineSupervisor, InFlightCounts, SharedEngine


class OneOfSeveral(DrainingServer):
    """A uvicorn server sharing its event loop with others: main() turns SIGTERM into should_exit on all of
    them, since each server's own handler would replace the one installed before it."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def app_flags(argv: list[str]) -> list[list[str]]:
    """The moe-serve flags of each app: argv less its --also-serve pairs, then one list per pair."""
    extra = argparse.ArgumentParser(prog="parser_servers")
    extra.add_argument("--also-serve", action="append", default=[], metavar="PARSER=PORT")
    ours, flags = extra.parse_known_args(argv)
    pairs = [pair.split("=", 1) for pair in ours.also_serve]
    return [flags] + [[*flags, "--tool-call-parser", parser, "--port", port] for parser, port in pairs]


def build_server(flags: list[str], engine_config: EngineConfig, shared: SharedEngine,
                 on_fatal: Callable[[], None]) -> tuple[OneOfSeveral, socket.socket]:
    """The app of one moe-serve command line, as cli.serve builds it, attached to the shared engine."""
    settings = server_settings_from_args(parse_args(flags))
    app = create_app(settings, engine_config, on_fatal=on_fatal, shared=shared)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=engine_config.logging.level,
                            log_config=engine_config.logging.dict_config(),
                            timeout_graceful_shutdown=settings.graceful_shutdown_seconds,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS, access_log=settings.access_log)
    server = OneOfSeveral(config, app.state.moe.engine, settings.drain_seconds)
    return server, bind_listener(settings.host, settings.port)


async def serve_all(servers: list[tuple[OneOfSeveral, socket.socket]], stop: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    await asyncio.gather(*(server.serve(sockets=[listener]) for server, listener in servers))


def main(argv: list[str]) -> int:
    every_flags = app_flags(argv)
    engine_config = engine_config_from_args(parse_args(every_flags[0]))
    engine_config.logging.apply()
    addresses = channel_addresses(len(every_flags))
    servers: list[tuple[OneOfSeveral, socket.socket]] = []

    def stop() -> None:  # a signal, or an engine that cannot start (every app hears of it)
        for server, _ in servers:
            server.should_exit = True

    servers += [build_server(flags, engine_config, SharedEngine(address, InFlightCounts.private()), stop)
                for flags, address in zip(every_flags, addresses)]
    supervisor = EngineSupervisor(engine_config, addresses)
    supervisor.start()
    try:
        asyncio.run(serve_all(servers, stop))
    finally:
        supervisor.stop()
        shutil.rmtree(Path(addresses[0].path).parent, ignore_errors=True)
    return 1 if any(server.engine.fatal_error for server, _ in servers) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
