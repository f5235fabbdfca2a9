"""The server's side of the engine process: spawn it, route its outputs, restart it when it dies.

A supervisor thread owns the process and its two multiprocessing queues. It hands each
StepOutputs (one engine step's RequestOutputs) to the event loop in one call, where each output
lands in the OutputSink of the HTTP request that owns it. If the process dies, every request in
flight gets EngineLost, /health goes 503, and a new process is started (with back-off) while new
requests are refused with 503.
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.messages import (
    AbortRequest,
    EngineFailed,
    EngineReady,
    GenerateRequest,
    MetricsSnapshot,
    Shutdown,
    StepOutputs,
)
from moe_serve.engine.process import run_engine
from moe_serve.server.output_sink import EngineLost, OutputSink

log = logging.getLogger("moe_serve")

POLL_SECONDS = 0.2  # how often the supervisor checks that the process is alive when it is quiet
MAX_BACKOFF_SECONDS = 30.0


class EngineUnavailable(Exception):
    pass


@dataclass(frozen=True)
class _Ended:
    """How one engine process ended."""

    was_ready: bool
    reason: str
    load_failed: bool = False  # it reported EngineFailed: the model or the settings are wrong


@dataclass
class _Engine:
    process: mp.process.BaseProcess
    inbox: mp.Queue
    outbox: mp.Queue


class EngineClient:
    def __init__(self, config: EngineConfig, on_snapshot: Callable[[MetricsSnapshot], None],
                 on_restart: Callable[[], None], on_fatal: Callable[[], None]) -> None:
        self._config = config
        self._on_snapshot, self._on_restart, self._on_fatal = on_snapshot, on_restart, on_fatal
        self._ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads, locks or CUDA state
        self._routes: dict[str, OutputSink] = {}  # request id -> its HTTP request's sink (event loop only)
        self._engine: _Engine | None = None
        self._ready: EngineReady | None = None
        self._closing = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.fatal_error: str | None = None  # why the first start failed; then nothing is retried

    @property
    def ready(self) -> EngineReady | None:
        return self._ready

    @property
    def in_flight(self) -> int:
        return len(self._routes)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._supervise, name="engine-supervisor", daemon=True)
        self._thread.start()

    def submit(self, requests: list[GenerateRequest], sink: OutputSink) -> None:
        """Send requests to the engine; their outputs arrive in sink. Call on the event loop."""
        engine = self._engine
        if self._ready is None or engine is None:
            raise EngineUnavailable()
        for request in requests:
            self._routes[request.request_id] = sink
            engine.inbox.put(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop generating for these requests (client gone, stop string hit). Call on the event loop."""
        engine = self._engine
        for request_id in request_ids:
            if self._routes.pop(request_id, None) is not None and engine is not None:
                engine.inbox.put(AbortRequest(request_id))

    async def close(self, timeout: float = 10.0) -> None:
        self._closing.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)
        self._engine = None  # lets the queues' semaphores be released before the interpreter exits

    # ---- supervisor thread ----------------------------------------------------------------

    def _supervise(self) -> None:
        failures, ever_ready = 0, False
        while not self._closing.is_set():
            engine = self._spawn()
            ended = self._serve(engine)
            self._stop(engine)
            if self._closing.is_set():
                return
            if ended.load_failed and not ever_ready:
                self.fatal_error = ended.reason  # bad model, bad flags: retrying cannot help
                self._call_soon(self._on_fatal)
                return
            ever_ready |= ended.was_ready
            failures = 0 if ended.was_ready else failures + 1
            self._lose_engine(ended.reason)
            self._closing.wait(min(0.5 * 2**failures, MAX_BACKOFF_SECONDS))

    def _spawn(self) -> _Engine:
        inbox, outbox = self._ctx.Queue(), self._ctx.Queue()
        process = self._ctx.Process(target=run_engine, args=(self._config, inbox, outbox), name="moe-engine",
                                    daemon=True)
        process.start()
        log.info("engine process started (pid %d); loading %s", process.pid, self._config.model)
        self._engine = _Engine(process, inbox, outbox)
        return self._engine

    def _serve(self, engine: _Engine) -> _Ended:
        """Pump the outbox until the process ends (or the server shuts down)."""
        ready = False
        while not self._closing.is_set():
            try:
                message = engine.outbox.get(timeout=POLL_SECONDS)
            except queue.Empty:
                if not engine.process.is_alive():
                    return _Ended(ready, f"engine process {engine.process.pid} exited with code "
                                         f"{engine.process.exitcode}")
                continue
            if isinstance(message, StepOutputs):
                self._call_soon(self._deliver, message)
            elif isinstance(message, MetricsSnapshot):
                self._on_snapshot(message)
            elif isinstance(message, EngineReady):
                ready = True
                self._call_soon(self._set_ready, message)
            elif isinstance(message, EngineFailed):
                log.error("engine failed to start: %s", message.message)
                return _Ended(ready, message.message, load_failed=True)
        return _Ended(ready, "server shutting down")

    def _stop(self, engine: _Engine) -> None:
        if engine.process.is_alive():
            engine.inbox.put(Shutdown())
            engine.process.join(timeout=10)
        if engine.process.is_alive():
            engine.process.kill()
            engine.process.join()
        for q in (engine.inbox, engine.outbox):
            # Left open: a late abort may still be put into the dead inbox, harmlessly; but with no
            # reader its feeder thread could block, and it must not hold up the server's exit.
            q.cancel_join_thread()

    def _lose_engine(self, message: str) -> None:
        log.error("%s; failing requests in flight and restarting the engine", message)
        self._ready = None
        self._on_restart()
        self._call_soon(self.fail_in_flight, f"the engine process died ({message}); retry the request")

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

    def fail_in_flight(self, message: str) -> None:
        """End every request in flight with a 503 carrying message and abort it in the engine
        (the engine died, or the server is shutting down). Call on the event loop."""
        lost = EngineLost(message)
        for sink in set(self._routes.values()):
            sink.put_nowait(lost)
        self.abort(list(self._routes))
