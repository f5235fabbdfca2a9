"""The server's side of the engine process: its channel to the engine, and who restarts the engine.

`EngineClient` is one API server process' end. A thread accepts the engine's connection on this
process' channel (moe_serve/engine/channel.py) and reads it; each StepOutputs (one engine step's
outputs for this process) goes to the event loop in one call, where each output lands in the
OutputSink of the HTTP request that owns it. When the channel closes (the engine died), every
request in flight gets EngineLost, /health goes 503 and new requests get 503 until a new engine
process connects.

`EngineSupervisor` starts the engine process and starts a new one (with back-off) when it dies,
except after a start-up that failed: the model or the settings are wrong. With one API server it
runs in that server's process; with --api-server-count N in the parent of all N (server/cli.py).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import threading
from collections.abc import Callable, Iterable
from ctypes import Array, c_bool, c_int
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray

from moe_serve.engine.channel import Channel, ChannelAddress, ChannelListener
from moe_serve.engine.config import EngineConfig
from moe_serve.engine.messages import (
    AbortRequest,
    EngineFailed,
    EngineReady,
    GenerateRequest,
    MetricsSnapshot,
    StepOutputs,
)
from moe_serve.engine.process import START_FAILED_EXIT_CODE, run_engine
from moe_serve.server.output_sink import EngineLost, OutputSink

log = logging.getLogger("moe_serve")

MAX_BACKOFF_SECONDS = 30.0
ACCEPT_POLL_SECONDS = 0.2  # how often a link thread waiting for an engine checks for shutdown
STOP_SECONDS = 10.0  # an engine told to stop (its channels closed) gets this long before it is killed


class EngineUnavailable(Exception):
    pass


class InFlightCounts:
    """Engine requests in flight per API server process, in shared memory without a lock: each process writes
    only its own slot, and --max-queue holds for their sum (processes admitting at the same moment may pass it
    by a few: the price of taking no lock on every request)."""

    def __init__(self, slots: Array, index: int) -> None:
        self._slots, self._index = slots, index

    @classmethod
    def private(cls) -> InFlightCounts:
        return cls(RawArray(c_int, 1), 0)

    def set(self, count: int) -> None:
        self._slots[self._index] = count

    @property
    def total(self) -> int:
        return sum(self._slots)


@dataclass(frozen=True)
class SharedEngine:
    """What each of --api-server-count's processes is given: where it hears from the engine its parent runs,
    and its slot of the in-flight counts."""

    channel: ChannelAddress
    in_flight: InFlightCounts


class EngineClient:
    def __init__(self, address: ChannelAddress, in_flight: InFlightCounts,
                 on_snapshot: Callable[[MetricsSnapshot], None], on_restart: Callable[[], None],
                 on_fatal: Callable[[], None]) -> None:
        self._address, self._in_flight = address, in_flight
        self._on_snapshot, self._on_restart, self._on_fatal = on_snapshot, on_restart, on_fatal
        self._routes: dict[str, OutputSink] = {}  # request id -> its HTTP request's sink (event loop only)
        self._channel: Channel | None = None
        self._ready: EngineReady | None = None
        self._closing = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._listener = ChannelListener(address)  # before any engine starts, so it can connect at once
        self.fatal_error: str | None = None  # why the engine could not start; then the server stops

    @property
    def ready(self) -> EngineReady | None:
        return self._ready

    @property
    def in_flight(self) -> int:
        """Engine requests in flight from every API server process."""
        return self._in_flight.total

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._link, name="engine-link", daemon=True)
        self._thread.start()

    def submit(self, requests: list[GenerateRequest], sink: OutputSink) -> None:
        """Send requests to the engine; their outputs arrive in sink. Call on the event loop."""
        channel = self._channel
        if self._ready is None or channel is None:
            raise EngineUnavailable()
        for request in requests:
            self._routes[request.request_id] = sink
            channel.send(request)
        self._in_flight.set(len(self._routes))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop generating for these requests (client gone, stop string hit). Call on the event loop."""
        channel = self._channel
        for request_id in request_ids:
            if self._routes.pop(request_id, None) is not None and channel is not None:
                channel.send(AbortRequest(request_id))
        self._in_flight.set(len(self._routes))

    async def close(self, timeout: float = 10.0) -> None:
        """Hang up on the engine: it aborts this server's requests, and exits once every API server has."""
        self._closing.set()
        channel = self._channel
        if channel is not None:
            await asyncio.to_thread(channel.hang_up)  # the link thread reads EOF and closes it
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._listener.close()

    # ---- link thread ----------------------------------------------------------------------

    def _link(self) -> None:
        """Accept each engine process in turn and read its messages until it is gone."""
        while not self._closing.is_set():
            try:
                channel = self._listener.accept(ACCEPT_POLL_SECONDS)
            except (OSError, EOFError, mp.AuthenticationError) as exc:  # a peer without the key, or one gone
                log.warning("engine connection refused: %s", exc)
                continue
            if channel is None:
                continue
            self._channel = channel
            ended = self._read(channel)
            self._channel = None
            channel.close()
            if self._closing.is_set() or ended is None:
                return
            self._lose_engine(ended)

    def _read(self, channel: Channel) -> str | None:
        """Deliver the engine's messages. Why it ended (its reason to give requests in flight), or None
        when it could not start at all."""
        while True:
            try:
                message = channel.recv()
            except (EOFError, OSError):
                return "the engine process died"
            if isinstance(message, StepOutputs):
                self._call_soon(self._deliver, message)
            elif isinstance(message, MetricsSnapshot):
                self._on_snapshot(message)
            elif isinstance(message, EngineReady):
                self._call_soon(self._set_ready, message)
            elif isinstance(message, EngineFailed):
                log.error("engine failed to start: %s", message.message)
                if self._ready is None and self.fatal_error is None:  # never served: bad model or flags
                    self.fatal_error = message.message
                    self._call_soon(self._on_fatal)
                    return None
                return message.message

    def _lose_engine(self, message: str) -> None:
        log.error("%s; failing requests in flight until a new engine process is ready", message)
        self._ready = None
        self._on_restart()
        self._call_soon(self.fail_in_flight, f"{message}; retry the request")

    def _call_soon(self, fn: Callable, *args: object) -> None:
        assert self._loop is not None  # set by start() before the thread exists
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop already closed during shutdown
            pass

    # ---- event loop side ------------------------------------------------------------------

    def _set_ready(self, ready: EngineReady) -> None:
        self._ready = ready
        log.info("engine ready: %s (max_model_len %d, vocab %d) %s", ready.model_name, ready.max_model_len,
                 ready.vocab_size, ready.settings)

    def _deliver(self, step: StepOutputs) -> None:
        for output in step.outputs:
            sink = self._routes.get(output.request_id)
            if sink is None:  # aborted or failed already; a late output is dropped
                continue
            if output.finish_reason is not None:
                del self._routes[output.request_id]
            sink.put_nowait(output)
        self._in_flight.set(len(self._routes))

    def fail_in_flight(self, message: str) -> None:
        """End every request in flight with a 503 carrying message and abort it in the engine
        (the engine died, or the server is shutting down). Call on the event loop."""
        lost = EngineLost(message)
        for sink in set(self._routes.values()):
            sink.put_nowait(lost)
        self.abort(list(self._routes))


class EngineSupervisor:
    """Runs the engine process for the API servers listening at addresses, restarting it when it dies."""

    def __init__(self, config: EngineConfig, addresses: tuple[ChannelAddress, ...]) -> None:
        self._config, self._addresses = config, addresses
        self._ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads, locks or CUDA state
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop restarting; the running engine exits once its channels close, or is killed STOP_SECONDS on."""
        self._closing.set()
        self._thread.join(STOP_SECONDS + 1.0)

    def _supervise(self) -> None:
        failures, ever_ready = 0, False
        while not self._closing.is_set():
            was_ready = self._ctx.RawValue(c_bool, False)
            process = self._ctx.Process(target=run_engine, args=(self._config, self._addresses, was_ready),
                                        name="moe-engine", daemon=True)
            process.start()
            log.info("engine process started (pid %d); loading %s", process.pid, self._config.model)
            while process.is_alive() and not self._closing.is_set():
                process.join(0.2)
            if self._closing.is_set():
                _stop_process(process)
                return
            log.error("engine process %d exited with code %s", process.pid, process.exitcode)
            if process.exitcode == START_FAILED_EXIT_CODE and not ever_ready:
                return  # bad model, bad flags: retrying cannot help (the API servers heard why, and stop)
            ever_ready |= bool(was_ready.value)
            failures = 0 if was_ready.value else failures + 1
            self._closing.wait(min(0.5 * 2**failures, MAX_BACKOFF_SECONDS))


def _stop_process(process: mp.process.BaseProcess) -> None:
    process.join(STOP_SECONDS)
    if process.is_alive():
        process.kill()
        process.join()
