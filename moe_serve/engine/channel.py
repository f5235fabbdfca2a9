"""The link between one API server process and the engine process: an authenticated local socket.

Each API server process listens at its own address; the engine process connects to every one of
them when it starts (so an engine that was restarted simply connects again). A local socket rather
than multiprocessing queues because a peer killed mid-message only closes its end (the other side
reads EOF), whereas a queue's locks stay held by a killed process and wedge its successor.

Sends are queued to a thread, as multiprocessing.Queue does, so neither the engine loop nor the
server's event loop ever blocks on a full socket buffer or spends its time pickling.
"""
from __future__ import annotations

import contextlib
import os
import queue
import secrets
import socket
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge, wait

CONNECT_TIMEOUT_SECONDS = 60.0  # an engine started before its API processes listen waits this long for them


@dataclass(frozen=True)
class ChannelAddress:
    """Where one API server process listens for the engine, and the key both ends must prove."""

    path: str
    authkey: bytes = field(repr=False)


def channel_addresses(count: int) -> tuple[ChannelAddress, ...]:
    """Addresses in a new folder only this user can enter; one key for all (they share one server)."""
    folder = tempfile.mkdtemp(prefix="moe-serve-")  # mode 0700
    authkey = secrets.token_bytes(32)
    return tuple(ChannelAddress(os.path.join(folder, f"api-{i}.sock"), authkey) for i in range(count))


class ChannelListener:
    """An API server process' end: accepts each engine process that connects, after the key handshake
    (multiprocessing's own challenge, as its Listener does; a Listener's accept cannot be woken to stop)."""

    def __init__(self, address: ChannelAddress) -> None:
        self._address = address
        if os.path.exists(address.path):  # a previous server's socket file left behind
            os.unlink(address.path)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket.bind(address.path)
        self._socket.listen()

    def accept(self, timeout: float) -> Channel | None:
        """The next engine's channel, or None if none connected within timeout. AuthenticationError if the
        peer does not hold the key."""
        if not wait([self._socket], timeout):
            return None
        connection = Connection(self._socket.accept()[0].detach())
        try:
            deliver_challenge(connection, self._address.authkey)
            answer_challenge(connection, self._address.authkey)
        except BaseException:
            connection.close()
            raise
        return Channel(connection)

    def close(self) -> None:
        self._socket.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._address.path)
        with contextlib.suppress(OSError):  # the last API process out removes the folder
            os.rmdir(os.path.dirname(self._address.path))


def connect(address: ChannelAddress, timeout: float = CONNECT_TIMEOUT_SECONDS) -> Channel:
    """The engine's end of one API process' channel, retrying until that process listens."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return Channel(Client(address.path, family="AF_UNIX", authkey=address.authkey))
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class Channel:
    """One end of a duplex link: recv on the owner's thread, send from any thread (never blocks)."""

    def __init__(self, connection: Connection) -> None:
        self.connection = connection
        self._sends: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._gone = False  # the other end stopped reading: later sends are dropped, not queued forever
        self._sender = threading.Thread(target=self._send_loop, name="channel-sender", daemon=True)
        self._sender.start()

    def send(self, message: object) -> None:
        if not self._gone:
            self._sends.put(message)

    def poll(self, timeout: float = 0.0) -> bool:
        return self.connection.poll(timeout)

    def recv(self) -> object:
        """The next message; EOFError (or OSError) once the other end is gone."""
        return self.connection.recv()

    def hang_up(self, flush_seconds: float = 2.0) -> None:
        """Send what is queued (for up to flush_seconds), then shut the socket: both ends read EOF. Safe
        while another thread is in recv(), which close() is not."""
        self._sends.put(_CLOSE)
        self._sender.join(flush_seconds)
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self.connection.fileno())) as sock:
            sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Hang up and release the socket; by the thread that reads, or when nothing does."""
        self.hang_up()
        self.connection.close()

    def _send_loop(self) -> None:
        while (message := self._sends.get()) is not _CLOSE:
            try:
                self.connection.send(message)
            except (OSError, ValueError):  # the other end is gone (or this end closed): nothing to deliver to
                self._gone = True
                return


_CLOSE = object()
