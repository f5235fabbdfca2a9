"""The engine process: build EngineCore, then loop take messages -> step -> send outputs.

A pass's outputs (one per sequence stepped, plus rejections and aborts) leave as one StepOutputs.

Runs in a spawned process with two multiprocessing queues and nothing else: no sockets, no
HTTP, no JSON. It blocks on its inbox only when it has nothing to do, and then only briefly so
MetricsSnapshots keep flowing and it notices when the server process is gone.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import signal
import time
from typing import TYPE_CHECKING

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.messages import (
    AbortRequest,
    EngineFailed,
    GenerateRequest,
    RequestOutput,
    Shutdown,
    StepOutputs,
)

if TYPE_CHECKING:
    from moe_serve.engine.core import EngineCore

SNAPSHOT_SECONDS = 0.5
log = logging.getLogger(__name__)


def run_engine(config: EngineConfig, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """Process entry point. Sends EngineReady or EngineFailed first, then outputs and snapshots."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    config.logging.apply()
    try:
        from moe_serve.engine.core import EngineCore  # imported here so a broken model import is an EngineFailed too

        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 - any start-up failure must reach the server as EngineFailed
        # a ValueError is a setting or checkpoint the engine cannot use (ConfigError, LoadError): the
        # server reports its message in one line; anything else is a bug and shows its traceback
        log.log(logging.DEBUG if isinstance(exc, ValueError) else logging.ERROR, "engine start-up failed",
                exc_info=True)
        outbox.put(EngineFailed(f"{type(exc).__name__}: {exc}"))
        return
    try:
        outbox.put(core.ready_info())
        EngineLoop(core, inbox, outbox).run()
    finally:
        core.close()


class EngineLoop:
    def __init__(self, core: EngineCore, inbox: mp.Queue, outbox: mp.Queue) -> None:
        self.core, self.inbox, self.outbox = core, inbox, outbox
        self._last_snapshot = 0.0
        self._outputs: list[RequestOutput] = []  # this pass's, sent together

    def run(self) -> None:
        while self.take_messages():
            if self.core.has_unfinished():
                self._outputs.extend(self.core.step())
            self.send_outputs()
            self.maybe_snapshot()

    def send_outputs(self) -> None:
        if self._outputs:
            self.outbox.put(StepOutputs(tuple(self._outputs)))
            self._outputs = []

    def take_messages(self) -> bool:
        """Handle everything queued; wait only when idle. False once it is time to exit."""
        block = not self.core.has_unfinished()
        while True:
            try:
                message = self.inbox.get(timeout=SNAPSHOT_SECONDS) if block else self.inbox.get_nowait()
            except queue.Empty:
                return _parent_alive()
            block = False
            if isinstance(message, Shutdown):
                return False
            self.handle(message)

    def handle(self, message: GenerateRequest | AbortRequest) -> None:
        if isinstance(message, GenerateRequest):
            rejected = self.core.add_request(message)
            if rejected is not None:
                self._outputs.append(rejected)
        elif isinstance(message, AbortRequest):
            final = self.core.abort_request(message.request_id)
            if final is not None:
                self._outputs.append(final)

    def maybe_snapshot(self) -> None:
        now = time.monotonic()
        if now - self._last_snapshot >= SNAPSHOT_SECONDS:
            self._last_snapshot = now
            self.outbox.put(self.core.metrics_snapshot())


def _parent_alive() -> bool:
    parent = mp.parent_process()
    return parent is None or parent.is_alive()
