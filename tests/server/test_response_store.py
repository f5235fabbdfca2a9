"""moe_serve/server/response_store.py: the bounds (the newest responses within a count and a size, the
oldest go first), a response back as it went in, and one file shared by stores in other threads and
processes, as the API server processes of --api-server-count share it."""
from __future__ import annotations

import multiprocessing as mp
import threading
from pathlib import Path

import pytest

from moe_serve.server.errors import APIError
from moe_serve.server.response_store import ResponseStore, StoredResponse


def _stored(number: int, text: str = "hello") -> StoredResponse:
    body = {"id": f"resp_{number}", "object": "response", "status": "completed", "usage": None,
            "output": [{"type": "message", "content": [{"type": "output_text", "text": f"é {number}"}]}]}
    return StoredResponse(body, ({"role": "user", "content": text},
                                 {"role": "assistant", "content": f"é {number}", "tool_calls": [{"id": "c"}]}))


def _kept(store: ResponseStore, numbers: range) -> list[int]:
    kept = []
    for number in numbers:
        try:
            store.get(f"resp_{number}")
        except APIError:
            continue
        kept.append(number)
    return kept


def _put_many(store: ResponseStore, first: int, count: int) -> None:
    for number in range(first, first + count):
        store.put(_stored(number))


@pytest.fixture(params=["private", "file"])
def store_path(request: pytest.FixtureRequest, tmp_path: Path) -> str | None:
    return None if request.param == "private" else str(tmp_path / "responses.sqlite3")


def test_a_stored_response_comes_back_as_it_went_in(store_path: str | None) -> None:
    store = ResponseStore(store_path)
    store.put(_stored(1))
    assert store.get("resp_1") == _stored(1) and isinstance(store.get("resp_1").conversation, tuple)
    with pytest.raises(APIError) as info:
        store.get("resp_2", "previous_response_id")
    assert (info.value.status, info.value.code, info.value.param) == (404, "response_not_found",
                                                                      "previous_response_id")


def test_the_store_keeps_the_newest_responses_within_its_count(store_path: str | None) -> None:
    store = ResponseStore(store_path, max_responses=3)
    _put_many(store, 0, 5)
    assert _kept(store, range(5)) == [2, 3, 4]


def test_the_store_keeps_the_newest_responses_within_its_characters(store_path: str | None) -> None:
    size = _stored(0).size
    store = ResponseStore(store_path, max_characters=size * 5 // 2)
    _put_many(store, 0, 4)
    assert _kept(store, range(4)) == [2, 3]
    store.put(_stored(4, "x" * size))  # about twice the size of the others: both go
    assert _kept(store, range(5)) == [4]
    store.put(_stored(5, "x" * size * 3))  # alone past the bound: not kept either
    assert _kept(store, range(6)) == []


def test_private_stores_are_apart() -> None:
    first, second = ResponseStore(), ResponseStore()
    first.put(_stored(1))
    assert _kept(first, range(2)) == [1] and _kept(second, range(2)) == []


def test_stores_on_one_file_see_each_others_responses_across_threads(tmp_path: Path) -> None:
    path = str(tmp_path / "responses.sqlite3")
    store, other = ResponseStore(path), ResponseStore(path)
    store.put(_stored(0))
    assert other.get("resp_0") == _stored(0)
    threads = [threading.Thread(target=_put_many, args=(store, first, 20)) for first in (1, 21)]
    for thread in threads:
        thread.start()
    _put_many(other, 41, 20)
    for thread in threads:
        thread.join()
    assert _kept(store, range(61)) == _kept(other, range(61)) == list(range(61))


def _put_from_another_process(store: ResponseStore | str, first: int, count: int) -> None:
    store = ResponseStore(store, max_responses=100) if isinstance(store, str) else store
    if store.get("resp_0") != _stored(0):  # the parent's
        raise AssertionError("the parent's response differs")
    _put_many(store, first, count)


# spawn: each child opens the file; fork: each child goes on with the parent's store, on a connection of its own
@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_stores_on_one_file_see_each_others_responses_across_processes(tmp_path: Path, method: str) -> None:
    path = str(tmp_path / "responses.sqlite3")
    store = ResponseStore(path, max_responses=100)
    store.put(_stored(0))
    context = mp.get_context(method)
    children = [context.Process(target=_put_from_another_process, args=(path if method == "spawn" else store,
                                                                         first, 30)) for first in (1, 31)]
    for child in children:
        child.start()
    _put_many(store, 61, 30)  # while the children write
    for child in children:
        child.join(timeout=120)
    assert [child.exitcode for child in children] == [0, 0]
    assert _kept(store, range(91)) == list(range(91))
    _put_many(store, 91, 10)  # the count holds over every process's responses, the first one goes
    assert _kept(store, range(101)) == list(range(1, 101))


def _open_at_once(path: str, barrier: threading.Barrier, number: int) -> None:
    barrier.wait()
    ResponseStore(path).put(_stored(number))


def test_processes_opening_a_new_file_at_once_all_get_the_store(tmp_path: Path) -> None:
    """As the API server processes do at start-up, when they race to switch the new file to WAL."""
    context = mp.get_context("fork")
    for attempt in range(10):
        path, barrier = str(tmp_path / f"responses{attempt}.sqlite3"), context.Barrier(8)
        children = [context.Process(target=_open_at_once, args=(path, barrier, number)) for number in range(8)]
        for child in children:
            child.start()
        for child in children:
            child.join(timeout=60)
        assert [child.exitcode for child in children] == [0] * 8
        assert _kept(ResponseStore(path), range(8)) == list(range(8))
