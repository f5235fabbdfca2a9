"""The engine process: build EngineCore, then loop take messages -> step -> send outputs.

It serves one or more API server processes, each over its own channel (moe_serve/engine/channel.py,
the engine connects to all of them first). A request's outputs go back on the channel it came
from; a pass's outputs for one channel leave as one StepOutputs; snapshots and the ready/failed
message go to every channel.

Runs in a spawned process with its channels and nothing else: no HTTP, no JSON. It blocks on its
channels only when it has nothing to do, and then only briefly so MetricsSnapshots keep flowing and
it notices when the process that started it is gone. An API process that hangs up (it is stopping, or
died) has its requests aborted; the engine exits once every one has hung up.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import time
from ctypes import c_bool
from dataclasses import replace
from multiprocessing.connection import wait
from typing import TYPE_CHECKING

from moe_serve.engine.channel import Channel, ChannelAddress, connect
from moe_serve.engine.config import EngineConfig
from moe_serve.engine.messages import (
    AbortRequest,
    EngineFailed,
    GenerateRequest,
    RequestOutput,
    StepOutputs,
)

if TYPE_CHECKING:
    from moe_serve.engine.core import EngineCore

SNAPSHOT_SECONDS = 0.5
START_FAILED_EXIT_CODE = 3  # the model or the settings cannot be used: starting again cannot help
log = logging.getLogger(__name__)


def run_engine(config: EngineConfig, addresses: tuple[ChannelAddress, ...], was_ready: c_bool) -> None:
    """Process entry point. Sends EngineReady (and sets was_ready) or EngineFailed first, then outputs and
    snapshots. was_ready is shared memory without a lock (a kill cannot leave one held), read by the supervisor."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the server decides
    config.logging.apply()
    channels = [connect(address) for address in addresses]
    try:
        from moe_serve.engine.core import EngineCore  # imported here so a broken model import is an EngineFailed too

        core = EngineCore(config)
    except Exception as exc:  # noqa: BLE001 - any start-up failure must reach the server as EngineFailed
        # a ValueError is a setting or checkpoint the engine cannot use (ConfigError, LoadError): the
        # server reports its message in one line; anything else is a bug and shows its traceback
        log.log(logging.DEBUG if isinstance(exc, ValueError) else logging.ERROR, "engine start-up failed",
                exc_info=True)
        _close_all(channels, EngineFailed(f"{type(exc).__name__}: {exc}"))
        raise SystemExit(START_FAILED_EXIT_CODE) from None
    try:
        ready = core.ready_info()
        for channel in channels:
            channel.send(ready)
        was_ready.value = True
        EngineLoop(core, channels).run()
    finally:
        core.close()
        _close_all(channels)


def _close_all(channels: list[Channel], last: object | None = None) -> None:
    for channel in channels:
        if last is not None:
            channel.send(last)
        channel.close()


class EngineLoop:
    def __init__(self, core: EngineCore, channels: list[Channel]) -> None:
        self.core, self.channels = core, channels
        self._last_snapshot = 0.0
        self._owner: dict[str, int] = {}  # request id -> index of the channel it came on
        self._outputs: list[list[RequestOutput]] = [[] for _ in channels]  # this pass's, per channel
        self._hung_up: set[Channel] = set()

    def run(self) -> None:
        while self.take_messages():
            if self.core.has_unfinished():
                for output in self.core.step():
                    self._route(output)
            self.send_outputs()
            self.maybe_snapshot()

    def send_outputs(self) -> None:
        for channel, outputs in zip(self.channels, self._outputs):
            if outputs and channel not in self._hung_up:
                channel.send(StepOutputs(tuple(outputs)))
            outputs.clear()

    def take_messages(self) -> bool:
        """Handle everything queued; wait only when idle. False once it is time to exit."""
        open_channels = [channel.connection for channel in self.channels if channel not in self._hung_up]
        timeout = 0.0 if self.core.has_unfinished() else SNAPSHOT_SECONDS
        readable = wait(open_channels, timeout)
        for index, channel in enumerate(self.channels):
            if channel.connection not in readable:
                continue
            try:
                while channel.poll():
                    self.handle(channel.recv(), index)
            except (EOFError, OSError):
                self._hang_up(index)
        return len(self._hung_up) < len(self.channels) and (bool(readable) or _parent_alive())

    def _hang_up(self, channel: int) -> None:
        """That API server process is gone: nobody will read its requests' outputs."""
        self._hung_up.add(self.channels[channel])
        for request_id in [r for r, owner in self._owner.items() if owner == channel]:
            self.core.abort_request(request_id)
            del self._owner[request_id]

    def handle(self, message: GenerateRequest | AbortRequest, channel: int) -> None:
        if isinstance(message, GenerateRequest):
            self._owner[message.request_id] = channel
            rejected = self.core.add_request(message)
            if rejected is not None:
                self._route(rejected)
        elif isinstance(message, AbortRequest):
            final = self.core.abort_request(message.request_id)
            if final is not None:
                self._route(final)

    def _route(self, output: RequestOutput) -> None:
        owner = self._owner.get(output.request_id)
        if owner is None:  # an abort of a request that had already finished
            return
        if output.finish_reason is not None:
            del self._owner[output.request_id]
        self._outputs[owner].append(output)

    def maybe_snapshot(self) -> None:
        now = time.monotonic()
        if now - self._last_snapshot >= SNAPSHOT_SECONDS:
            self._last_snapshot = now
            snapshot = self.core.metrics_snapshot()
            self.channels[0].send(snapshot)
            # the samples feed histograms that the API processes' metrics add up: one of them observes each
            others = replace(snapshot, tpot_samples=(), batch_size_samples=(), batch_token_samples=())
            for channel in self.channels[1:]:
                channel.send(others)


def _parent_alive() -> bool:
    parent = mp.parent_process()
    return parent is None or parent.is_alive()
