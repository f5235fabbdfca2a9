"""moe_serve/engine/channel.py: the API server ↔ engine link (no model, no torch)."""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from dataclasses import replace

import pytest

from moe_serve.engine.channel import Channel, ChannelAddress, ChannelListener, channel_addresses, connect


@pytest.fixture
def address() -> ChannelAddress:
    return channel_addresses(1)[0]


def accept_in_thread(listener: ChannelListener) -> tuple[threading.Thread, list]:
    got: list = []

    def run() -> None:
        try:
            got.append(listener.accept(timeout=10))
        except Exception as exc:  # noqa: BLE001 - the test reads what accept raised
            got.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, got


def test_messages_cross_both_ways_in_order(address: ChannelAddress) -> None:
    listener = ChannelListener(address)
    thread, got = accept_in_thread(listener)
    engine_end = connect(address)
    thread.join()
    [server_end] = got
    assert isinstance(server_end, Channel)
    for i in range(100):
        engine_end.send(("output", i))
    server_end.send("request")
    assert [server_end.recv() for _ in range(100)] == [("output", i) for i in range(100)]
    assert engine_end.recv() == "request"
    engine_end.close()
    with pytest.raises(EOFError):  # the engine is gone: the server reads EOF, not a hang
        server_end.recv()
    server_end.close()
    listener.close()


def test_hang_up_wakes_a_reader_blocked_in_another_thread(address: ChannelAddress) -> None:
    """What EngineClient.close relies on: the link thread blocked in recv() ends, it is not left hanging."""
    listener = ChannelListener(address)
    thread, got = accept_in_thread(listener)
    engine_end = connect(address)
    thread.join()
    [server_end] = got
    ended: list[type] = []
    reader = threading.Thread(target=lambda: ended.append(_recv_error(server_end)))
    reader.start()
    time.sleep(0.2)
    server_end.hang_up()
    reader.join(5)
    assert not reader.is_alive() and ended and issubclass(ended[0], (EOFError, OSError))
    with pytest.raises(EOFError):
        engine_end.recv()  # the other end sees the hang-up too
    server_end.close()
    engine_end.close()
    listener.close()


def _recv_error(channel: Channel) -> type:
    try:
        channel.recv()
    except (EOFError, OSError) as exc:
        return type(exc)
    return type(None)


def test_a_peer_without_the_key_is_refused(address: ChannelAddress) -> None:
    listener = ChannelListener(address)
    thread, got = accept_in_thread(listener)
    with pytest.raises(mp.AuthenticationError):
        connect(replace(address, authkey=b"not the key"))
    thread.join()
    assert isinstance(got[0], mp.AuthenticationError)
    thread, got = accept_in_thread(listener)  # and the next engine, with the key, still gets in
    connect(address).close()
    thread.join()
    assert isinstance(got[0], Channel)
    got[0].close()
    listener.close()


def test_an_engine_waits_for_a_server_not_yet_listening(address: ChannelAddress) -> None:
    late: list[ChannelListener] = []
    starter = threading.Timer(0.3, lambda: late.append(ChannelListener(address)))
    starter.start()
    connecting: list[Channel] = []
    thread = threading.Thread(target=lambda: connecting.append(connect(address, timeout=10)))
    thread.start()
    starter.join()
    channel = late[0].accept(timeout=10)
    thread.join(10)
    assert channel is not None and connecting
    channel.send("ready")
    assert connecting[0].recv() == "ready"
    for end in (channel, connecting[0]):
        end.close()
    late[0].close()


def test_no_engine_means_accept_returns_none(address: ChannelAddress) -> None:
    listener = ChannelListener(address)
    started = time.monotonic()
    assert listener.accept(timeout=0.2) is None
    assert time.monotonic() - started < 5
    listener.close()
