"""--api-server-count 2: two API server processes in front of one engine process, on one port.

Every connection may land on either process, so each check is made over fresh connections: the answers
equal the one-process server's, the Prometheus counters add up over both, a stored response is found
from either, a killed engine fails both processes' requests and comes back, and a SIGTERM stops all."""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import re
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from moe_serve.server.engine_client import InFlightCounts
from tests.server.conftest import RunningServer, start_server

REQUESTS = 16


@pytest.fixture(scope="module")
def pair(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("logs"), "--api-server-count", "2")
    yield running
    running.stop()


def api_pids(server: RunningServer) -> list[int]:
    [pids] = re.findall(r"2 API server processes started \(pids ([\d, ]+)\)", server.log())
    return [int(p) for p in pids.split(", ")]


def fresh_client(server: RunningServer) -> openai.OpenAI:
    """A client with its own connection pool: a new TCP connection, which either process may accept."""
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0,
                         http_client=httpx.Client(timeout=60))


def completion_text(server: RunningServer, prompt: str) -> str:
    with fresh_client(server) as client:
        return client.completions.create(model=server.model, prompt=prompt, max_tokens=12, temperature=0).choices[0].text


def test_answers_equal_the_one_process_servers(pair: RunningServer, server: RunningServer) -> None:
    prompts = [f"count {i}:" for i in range(REQUESTS)]
    with ThreadPoolExecutor(8) as pool:
        theirs = list(pool.map(lambda p: completion_text(pair, p), prompts))
    assert theirs == [completion_text(server, p) for p in prompts]


def test_metrics_add_up_over_both_processes(pair: RunningServer) -> None:
    def finished() -> float:
        return pair.metric('moe_requests_total{finish_reason="length"}')

    before = finished()
    for i in range(REQUESTS):  # one new connection each: both processes answer some
        completion_text(pair, f"tally {i}")
    # each scrape is answered by either process, and each must count every request
    assert {finished() - before for _ in range(8)} == {REQUESTS}
    assert pair.metric("moe_generation_tokens_total") >= REQUESTS * 12
    assert pair.metric("moe_batch_size_count") > 0  # the engine's samples are observed (by one process)


def test_a_stored_response_is_found_from_either_process(pair: RunningServer) -> None:
    with fresh_client(pair) as client:
        stored = client.responses.create(model=pair.model, input="hello", max_output_tokens=4)
    for _ in range(8):
        with fresh_client(pair) as client:
            assert client.responses.retrieve(stored.id).output_text == stored.output_text


def test_a_killed_engine_comes_back_for_both_processes(pair: RunningServer) -> None:
    [old_pid] = pair.engine_pids()
    os.kill(old_pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while len(pair.engine_pids()) < 2 or not all(pair.get("/health").status_code == 200 for _ in range(8)):
        assert time.monotonic() < deadline, pair.log()[-3000:]
        time.sleep(0.25)
    assert len(set(completion_text(pair, "again") for _ in range(6))) == 1


def test_sigterm_stops_every_process(tiny_model: Path, tmp_path: Path) -> None:
    running = start_server(tiny_model, tmp_path, "--api-server-count", "2")
    children = [*api_pids(running), *running.engine_pids()]
    assert completion_text(running, "bye")
    assert running.stop() == 0
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_max_queue_holds_for_the_requests_of_all_processes() -> None:
    """Each process writes its own slot; each checks --max-queue against the sum."""
    slots = multiprocessing.get_context("spawn").RawArray(ctypes.c_int, 2)
    first, second = InFlightCounts(slots, 0), InFlightCounts(slots, 1)
    first.set(3)
    second.set(5)
    assert first.total == second.total == 8
    first.set(0)
    assert second.total == 5
