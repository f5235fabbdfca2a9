"""moe-serve: flags (optionally from a YAML --config), start-up log, then uvicorn."""
from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import errno
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import threading
from pathlib import Path

import uvicorn
import yaml

from moe_serve.engine.channel import channel_addresses
from moe_serve.engine.cli import add_engine_arguments, engine_config_from_args, finish_engine_args, model_given
from moe_serve.engine.cli_flags import ENV_HELP, DefaultsHelpFormatter, env_argv
from moe_serve.engine.cli_flags import positive_int as _positive_int
from moe_serve.engine.config import ConfigError, EngineConfig
from moe_serve.engine.gguf import is_gguf
from moe_serve.engine.logging_config import adopt_transformers_logging
from moe_serve.server.engine_client import EngineClient, EngineSupervisor, InFlightCounts, SharedEngine
from moe_serve.server.reasoning import HARMONY_REASONING_PARSER, REASONING_PARSERS
from moe_serve.server.settings import SamplingDefaults, ServerSettings, read_chat_template
from moe_serve.server.tool_parsers import HARMONY_TOOL_CALL_PARSER, TOOL_PARSERS

log = logging.getLogger("moe_serve")
PRESETS = Path(__file__).resolve().parents[1] / "configs"  # package data: one YAML per preset
# Idle keep-alive connections are closed after this long. It must outlast the clients' own idle
# expiry (httpx, so the OpenAI SDK: 5 s): at uvicorn's 5 s both ends expire together, and a request
# sent on the connection just as the server closes it fails with a ReadError without reaching the app.
KEEP_ALIVE_SECONDS = 10


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-serve", formatter_class=DefaultsHelpFormatter,
        description=f"OpenAI-compatible server for MoE models. {ENV_HELP} Precedence: command line > --config "
                    "file > environment > default.")
    parser.add_argument("--config", metavar="FILE|PRESET",
                        help="YAML of flag values (keys are flag names without '--'), or the name of a preset "
                             f"shipped with the package ({', '.join(preset_names())}); command-line flags win "
                             "(default: none)")
    add_engine_arguments(parser)
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="Jinja chat template, a file or the template itself, instead of the checkpoint's "
                             "(default: the checkpoint's)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="sampling defaults for fields a request leaves unset: auto reads the model's "
                             "generation_config.json, vllm uses the OpenAI defaults, DIR reads DIR's")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--served-model-name", default=None, help="name clients use (default: --model's folder)")
    parser.add_argument("--api-key", default=os.environ.get("MOE_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $MOE_API_KEY; unset = open)")
    parser.add_argument("--max-queue", type=_positive_int, default=64,
                        help="engine requests in flight before new ones get 429")
    parser.add_argument("--api-server-count", type=_positive_int, default=1,
                        help="API server processes (HTTP, templates, detokenizing) in front of the one engine "
                             "process, sharing the port (vLLM's flag): one event loop serves ~6,000 streamed "
                             "tokens/s on a fast host; more take many concurrent clients past that")
    parser.add_argument("--max-tokens-cap", type=_positive_int, default=None,
                        help="largest max_tokens a request may ask for (default: what the context allows)")
    parser.add_argument("--max-body-bytes", type=_positive_int, default=4 * 1024 * 1024,
                        help="larger request bodies get 413")
    parser.add_argument("--metrics-require-key", action="store_true", help="/metrics needs the API key too")
    parser.add_argument("--drain-seconds", type=float, default=ServerSettings.drain_seconds,
                        help="on SIGTERM, how long requests in flight get to finish before they end with a 503")
    parser.add_argument("--allowed-origins", type=_comma_list, default=(), metavar="ORIGIN,...",
                        help="origins whose web pages may call this API from a browser (CORS), e.g. "
                             "http://localhost:3000, or * for any; default: none, since with no API key a page "
                             "the user visits could otherwise use the server (and with one, read the answers)")
    parser.add_argument("--allowed-methods", type=_comma_list, default=("*",), metavar="METHOD,...",
                        help="HTTP methods an allowed origin may use (default: *; the origin list is the gate)")
    parser.add_argument("--allowed-headers", type=_comma_list, default=("*",), metavar="HEADER,...",
                        help="request headers an allowed origin may send (default: *: the OpenAI SDKs send "
                             "Authorization and several x-stainless-* headers)")
    parser.add_argument("--enable-log-requests", action="store_true",
                        help="log a line per request (its id, prompt tokens, choices, user) at INFO; off by "
                             "default, as in vLLM: at a hundred requests a second the lines took ~10%% of the one "
                             "event loop's time per request")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no access-log line per response (vLLM's flag)")
    parser.add_argument("--tool-call-parser", choices=sorted([*TOOL_PARSERS, HARMONY_TOOL_CALL_PARSER]), default=None,
                        help="reads tool calls out of the model's text for tool_choice 'auto': hermes (Qwen2.5, "
                             "Qwen3, the embedded default model), mistral, llama3_json, deepseek_v3, glm45 "
                             "(GLM-4.5), qwen3_coder (Qwen3-Coder), minimax_m2, openai (gpt-oss's harmony format, "
                             "also on by itself for a gpt-oss checkpoint) (default: none, and 'auto' is a 400; "
                             "'required' and named functions work without one)")
    parser.add_argument("--reasoning-parser", choices=[*REASONING_PARSERS, HARMONY_REASONING_PARSER], default=None,
                        help="puts a chat answer's <think> section into reasoning_content: deepseek_r1 (the "
                             "template opens it), qwen3 (the answer opens it); openai_gptoss: the harmony format's "
                             "analysis channel (gpt-oss; on by itself for its checkpoints) (default: none, all "
                             "text is content)")
    return parser


def _comma_list(text: str) -> tuple[str, ...]:
    """"a, b" -> ("a", "b"). A YAML list in --config would arrive as its Python text: refused, not misread."""
    if text.lstrip().startswith("["):
        raise argparse.ArgumentTypeError(f"give a comma-separated string, not a list: {text}")
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags from the environment, then the --config file, then the command line: later ones win."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    from_env = env_argv(parser)
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    config_file = pre.parse_known_args(from_env + argv)[0].config
    from_file = [] if config_file is None else config_argv(config_path(config_file), parser)
    return finish_engine_args(parser, parser.parse_args(from_env + from_file + argv), argv)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS.glob("*.yaml"))


def config_path(value: str) -> Path:
    """--config's file, or a shipped preset named without its folder and suffix: an installed wheel's
    presets live in site-packages, where nobody should have to look them up."""
    path = Path(value)
    preset = PRESETS / f"{value}.yaml"
    return preset if not path.exists() and preset.is_file() else path


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
        if action is None or key in ("config", "help", "version"):
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
    """The server's settings; a ConfigError for flags the model cannot be served with."""
    from moe_serve.engine.loader import read_config  # torch: not for --help
    from moe_serve.server.harmony import uses_harmony

    harmony = uses_harmony(args.tool_call_parser, args.reasoning_parser, args.chat_template,
                           read_config(args.model).family)
    return ServerSettings(
        served_model_name=args.served_model_name or Path(args.model).name, host=args.host, port=args.port,
        api_key=args.api_key or None, max_queue=args.max_queue, max_tokens_cap=args.max_tokens_cap,
        metrics_require_key=args.metrics_require_key, max_body_bytes=args.max_body_bytes,
        drain_seconds=args.drain_seconds, tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser, harmony=harmony,
        chat_template=None if args.chat_template is None else read_chat_template(args.chat_template),
        sampling_defaults=SamplingDefaults.read(args.generation_config, args.model),
        allowed_origins=args.allowed_origins, allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers, log_requests=args.enable_log_requests,
        access_log=not args.disable_uvicorn_access_log,
    )


def startup_checks(args: argparse.Namespace, engine_config: EngineConfig) -> socket.socket:
    """Everything that can fail before the weights load, each failure a ConfigError of one line; then the
    listening socket, bound now so that a port in use fails here and nothing takes it meanwhile."""
    if args.config is not None and not model_given(args):
        raise ConfigError(f"--config {args.config} names no model, and a preset is made for one checkpoint: "
                          f"pass its folder (moe-serve DIR --config {args.config})")
    from moe_serve.engine.preflight import check_engine_config, check_tokenizer_dir  # torch: not for --help

    check_engine_config(engine_config)
    check_tokenizer_dir(engine_config.tokenizer_path, "--tokenizer" if engine_config.tokenizer else "--model")
    return bind_listener(args.host, args.port)


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, made with its protocol named (IPPROTO_TCP).

    Why the protocol: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted sockets
    whose proto is IPPROTO_TCP, and socket.create_server's sockets say 0. Without it, every request
    after the first on a kept-alive connection waited ~40 ms for the client's delayed ACK before its
    response's second segment left (measured: /health 1.7 ms on a new connection, 44 ms on a reused
    one, through curl and httpx alike)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             proto=socket.IPPROTO_TCP)[0]
        listener = socket.socket(family, kind, proto)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as create_server: restart at once
            listener.bind(address)
            listener.listen()
        except OSError:
            listener.close()
            raise
        return listener
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"port {port} on {host} is already in use: stop what holds it or pass --port") from exc
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc


def set_engine_threads(api_servers: int) -> None:
    """torch's default CPU thread pool spins against the server processes (per-token latency swung 4-208 ms on
    a small machine): when OMP_NUM_THREADS is unset, give the engine process the usable cores less one for
    each HTTP server process. The engine is spawned later and inherits the variable."""
    if "OMP_NUM_THREADS" in os.environ:
        log.info("OMP_NUM_THREADS=%s from the environment", os.environ["OMP_NUM_THREADS"])
        return
    cores = usable_cores()
    threads = max(1, cores - api_servers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    log.info("OMP_NUM_THREADS unset: the engine uses %d torch threads (%d usable cores, %d left to the HTTP "
             "server processes); set OMP_NUM_THREADS to choose", threads, cores, api_servers)


def usable_cores(cgroup_cpu_max: Path = Path("/sys/fs/cgroup/cpu.max")) -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (a container's
    --cpus sets a quota, not an affinity)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = cgroup_cpu_max.read_text().split()
    except (OSError, ValueError):
        return cores
    return cores if quota == "max" else max(1, min(cores, math.ceil(int(quota) / int(period))))


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
    engine_config = engine_config_from_args(args)
    engine_config.logging.apply()
    try:
        listener = startup_checks(args, engine_config)
        settings = server_settings_from_args(args)
        if settings.harmony:  # its vocabulary, before the engine starts: each API server process loads it again
            from moe_serve.server.harmony import load_encoding

            load_encoding()
    except ConfigError as exc:
        sys.exit(f"moe-serve: {exc}")
    set_engine_threads(args.api_server_count)
    log.info("server settings: %s", settings.describe())
    log.info("engine settings: %s", dataclasses.asdict(engine_config))
    log.info("OpenAI API at http://%s:%d/v1, Prometheus metrics at http://%s:%d/metrics", settings.host,
             settings.port, settings.host, settings.port)
    if args.api_server_count == 1:
        return serve(settings, engine_config, listener)
    return serve_with_api_servers(args.api_server_count, settings, engine_config, listener)


def serve(settings: ServerSettings, engine_config: EngineConfig, listener: socket.socket,
          shared: SharedEngine | None = None) -> int:
    """One API server process on listener until it is told to stop: with shared None it runs the engine
    process itself, else it is one of --api-server-count's. The exit code."""
    from moe_serve.server.app import create_app  # after the checks: importing it pulls in transformers

    adopt_transformers_logging()

    def stop() -> None:
        server.should_exit = True

    try:
        app = create_app(settings, engine_config, on_fatal=stop, shared=shared)
    except ConfigError as exc:  # harmony: its vocabulary gone since main's check, or not the model's tokenizer
        sys.exit(f"moe-serve: {exc}")
    except (OSError, ValueError) as exc:  # the tokenizer's files are there but transformers cannot read them
        # transformers builds no tokenizer of an olmoe, deepseek2, glm4moe, ernie4_5-moe, minimax-m2 or dots1 GGUF
        hint = ("; give the checkpoint's tokenizer folder as --tokenizer DIR" if engine_config.tokenizer is None
                and is_gguf(engine_config.model) else "")
        sys.exit(f"moe-serve: cannot load the tokenizer in {engine_config.tokenizer_path}: "
                 f"{str(exc).rstrip('.')}{hint}")
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=engine_config.logging.level,
                            log_config=engine_config.logging.dict_config(),
                            timeout_graceful_shutdown=settings.graceful_shutdown_seconds,
                            timeout_keep_alive=KEEP_ALIVE_SECONDS, access_log=settings.access_log)
    server = DrainingServer(config, app.state.moe.engine, settings.drain_seconds)
    # uvicorn re-raises a SIGTERM it handled once its graceful shutdown is done, which would make a
    # clean stop exit -15; set just before run(), this handler only ever sees that re-raise.
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[listener])
    fatal = app.state.moe.engine.fatal_error
    if fatal is not None:
        log.error("the engine could not start: %s", fatal)
        return 1
    return 0


def serve_with_api_servers(count: int, settings: ServerSettings, engine_config: EngineConfig,
                           listener: socket.socket) -> int:
    """--api-server-count N: this process runs the engine (restarting it as one API server would) and N API
    server processes that accept from the one listening socket (the kernel hands each new connection to one
    of them) and each talk to the engine over their own channel. HTTP-side Prometheus metrics are added up
    over the N (prometheus_client's multiprocess mode), stored responses live in one SQLite file, and
    --max-queue holds for the sum of their requests in flight (shared memory). A SIGTERM is passed on to
    the API servers, which drain; if one of them ends, the others are stopped too."""
    addresses = channel_addresses(count)
    folder = Path(addresses[0].path).parent
    metrics_dir = folder / "metrics"
    metrics_dir.mkdir()
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # read by prometheus_client in each API server
    settings = dataclasses.replace(settings, response_store_path=str(folder / "responses.sqlite"))
    ctx = multiprocessing.get_context("spawn")
    in_flight = ctx.RawArray(ctypes.c_int, count)
    servers = [ctx.Process(target=_api_server_main, name=f"moe-api-{i}",
                           args=(settings, engine_config, listener, SharedEngine(address, InFlightCounts(in_flight, i))))
               for i, address in enumerate(addresses)]
    for api_server in servers:
        api_server.start()
    listener.close()  # the API servers hold their own copies
    log.info("%d API server processes started (pids %s)", count, ", ".join(str(p.pid) for p in servers))
    supervisor = EngineSupervisor(engine_config, addresses)
    supervisor.start()

    told: set[int] = set()

    def stop_api_servers(*_: object) -> None:
        """SIGTERM each once: a second one could land in its interpreter's exit, where it kills."""
        for api_server in servers:
            if api_server.is_alive() and api_server.pid not in told:
                told.add(api_server.pid)
                os.kill(api_server.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop_api_servers)
    signal.signal(signal.SIGINT, stop_api_servers)
    try:
        multiprocessing.connection.wait([p.sentinel for p in servers])
        stop_api_servers()
        for api_server in servers:
            api_server.join()
    finally:
        supervisor.stop()
        shutil.rmtree(folder, ignore_errors=True)
    log.info("API server processes ended (exit codes %s)", ", ".join(str(p.exitcode) for p in servers))
    return max(abs(p.exitcode or 0) for p in servers)


def _api_server_main(settings: ServerSettings, engine_config: EngineConfig, listener: socket.socket,
                     shared: SharedEngine) -> None:
    """One of --api-server-count's processes. In a process group of its own, so a terminal's Ctrl-C reaches
    only the parent, which passes a SIGTERM on (a second signal would make uvicorn skip the drain); and if the
    parent dies without passing one, the server stops by itself rather than hold the port."""
    os.setpgrp()
    engine_config.logging.apply()
    parent = multiprocessing.parent_process()
    assert parent is not None  # a spawned child

    def stop_when_orphaned() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop_when_orphaned, name="parent-watch", daemon=True).start()
    sys.exit(serve(settings, engine_config, listener, shared))
