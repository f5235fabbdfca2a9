"""Faults under load, every surviving answer verified against its one-at-a-time greedy reference:
clients hanging up mid-stream, the engine process killed with SIGKILL, the server stopped with SIGTERM."""
from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from loadtest.run import (
    Answer,
    Mix,
    Prompt,
    Result,
    Target,
    engine_gauges,
    fetch_references,
    make_prompts,
    run_phase,
    wait_engine_idle,
)
from moe_serve.server.cli import KEEP_ALIVE_SECONDS
from tests.server.conftest import RunningServer, start_server

TIMEOUT_S = 60.0  # per request: a hang fails the test instead of stalling it
ENGINE_DOWN = "stream_error:engine_unavailable"  # what a stream in flight sees when the engine dies or the server stops
# The victim's SIGTERM drain is short and it batches at most 4 sequences, so the work queued when
# the signal comes always outlasts the drain however fast this machine decodes.
DRAIN_SECONDS = 0.5
VICTIM_MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def victim(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of this module's own: the kill test restarts its engine, the SIGTERM test stops it."""
    running = start_server(tiny_model, tmp_path_factory.mktemp("logs"), "--drain-seconds", str(DRAIN_SECONDS),
                           "--max-num-seqs", str(VICTIM_MAX_NUM_SEQS))
    yield running
    if running.process.poll() is None:
        running.stop()


def target(server: RunningServer) -> Target:
    return Target(server.base_url, server.model, "unused")


def references(server: RunningServer, prompts: list[Prompt]) -> list[Answer]:
    return asyncio.run(fetch_references(target(server), prompts, TIMEOUT_S))


def finished_total(gauges: dict[str, float]) -> float:
    return sum(v for k, v in gauges.items() if k.startswith("moe_requests_total"))


def assert_verified(results: list[Result], allowed: set[str]) -> Counter:
    statuses = Counter(r.status for r in results)
    assert set(statuses) <= allowed, statuses
    assert [r.problems for r in results if r.problems] == []
    return statuses


def test_half_the_clients_hang_up_mid_stream(server: RunningServer) -> None:
    """Hung-up requests are aborted and freed; the others finish untouched and verified."""
    prompts = make_prompts(16, 8, 48, 0.5, seed=11)
    refs = references(server, prompts)
    t = target(server)

    async def scenario() -> tuple[dict, list[Result], dict]:
        before = await wait_engine_idle(t)
        results, _ = await run_phase(t, prompts, refs, 16, Mix(raw_fraction=0.25, disconnect_fraction=0.5, seed=5),
                                     TIMEOUT_S, requests=64)
        return before, results, await wait_engine_idle(t)

    before, results, after = asyncio.run(scenario())
    statuses = assert_verified(results, {"ok", "disconnected"})
    assert 16 <= statuses["disconnected"] <= 48 and statuses["ok"] >= 16
    assert after["idle"], after
    # every request was finished exactly once server-side (stop/length, or abort for those cut short) ...
    deadline = time.monotonic() + 10
    while finished_total(asyncio.run(engine_gauges(t))) - finished_total(before) < len(results):
        assert time.monotonic() < deadline, "a request was never finished"
        time.sleep(0.2)
    assert finished_total(asyncio.run(engine_gauges(t))) - finished_total(before) == len(results)
    # ... and hanging up mid-generation really aborted work in the engine
    aborted = asyncio.run(engine_gauges(t))['moe_requests_total{finish_reason="abort"}']
    assert aborted - before['moe_requests_total{finish_reason="abort"}'] >= 8


def test_idle_connections_outlive_the_sdks_pool(server: RunningServer) -> None:
    """httpx (so the OpenAI SDK) reuses an idle connection for up to 5 s; the server must keep it longer, or a
    request sent on it just as the server closes it is lost (the first 10-minute soak lost 5 that way)."""
    client_expiry = httpx.Limits().keepalive_expiry
    assert KEEP_ALIVE_SECONDS > client_expiry
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock, sock.makefile("rb") as replies:
        for pause in (0, client_expiry + 1):
            time.sleep(pause)
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert replies.readline().startswith(b"HTTP/1.1 200"), f"closed after {pause} s idle"
            headers = dict(line.decode().lower().rstrip().split(": ", 1) for line in iter(replies.readline, b"\r\n"))
            replies.read(int(headers["content-length"]))


@pytest.fixture(scope="module")
def long_prompts() -> list[Prompt]:
    """Answers of up to 190 tokens (the test servers' context is 256): 16 of them are seconds of engine work."""
    return make_prompts(16, 4, 160, 0.2, seed=7)


@pytest.fixture(scope="module")
def long_refs(victim: RunningServer, long_prompts: list[Prompt]) -> list[Answer]:
    return references(victim, long_prompts)


async def _until_health(base_url: str, status: int, seen: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=10) as http:
        while time.monotonic() < deadline:
            seen.append((await http.get(base_url + "/health")).status_code)
            if seen[-1] == status:
                return
            await asyncio.sleep(0.05)
    raise AssertionError(f"/health never said {status}: {Counter(seen)}")


async def _non_streamed(t: Target, prompt: Prompt) -> int:
    """A non-streamed request's HTTP status (a 503 also has to be in OpenAI's error shape)."""
    async with openai.AsyncOpenAI(base_url=t.base_url + "/v1", api_key=t.api_key, max_retries=0) as sdk:
        try:
            await sdk.completions.create(model=t.model, prompt=prompt.text, max_tokens=200, temperature=0)
        except openai.APIStatusError as exc:
            assert exc.code == "engine_unavailable" and exc.type == "server_error", exc.body
            return exc.status_code
    return 200


def test_engine_killed_under_load(victim: RunningServer, long_prompts: list[Prompt], long_refs: list[Answer]) -> None:
    """SIGKILL the engine mid-load: requests in flight end with an error event or a 503, /health says 503,
    the engine comes back and later requests are answered and verified again."""
    t = target(victim)
    [old_engine] = victim.engine_pids()
    health: list[int] = []

    async def scenario() -> tuple[list[Result], list[int], list[Result]]:
        done: list[Result] = []
        load = asyncio.ensure_future(run_phase(t, long_prompts, long_refs, 8, Mix(raw_fraction=0.25, seed=9),
                                               TIMEOUT_S, requests=32, on_result=done.append))
        while len(done) < 4:
            await asyncio.sleep(0.02)
        plain = [asyncio.ensure_future(_non_streamed(t, p)) for p in long_prompts[:2]]  # queued behind the streams
        await asyncio.sleep(0.3)
        os.kill(old_engine, signal.SIGKILL)
        await _until_health(victim.base_url, 503, health, timeout=10)
        await _until_health(victim.base_url, 200, health, timeout=120)
        results, _ = await load
        after, _ = await run_phase(t, long_prompts, long_refs, 8, Mix(raw_fraction=0.25, seed=10), TIMEOUT_S,
                                   requests=16)
        return results, await asyncio.gather(*plain), after

    results, plain_statuses, after = asyncio.run(scenario())
    statuses = assert_verified(results, {"ok", "503", ENGINE_DOWN})
    assert statuses[ENGINE_DOWN] >= 1 and plain_statuses == [503, 503]
    assert assert_verified(after, {"ok"})["ok"] == 16  # the new engine answers exactly as the old one did
    [_, new_engine] = victim.engine_pids()
    assert new_engine != old_engine and not psutil.pid_exists(old_engine)
    assert asyncio.run(wait_engine_idle(t))["idle"]


def test_sigterm_drains_then_exits_zero(victim: RunningServer, long_prompts: list[Prompt],
                                        long_refs: list[Answer]) -> None:
    """SIGTERM with 48 streams in flight (more work than the drain allows): no new connections, each stream
    ends complete and verified or with an error event and [DONE] by the drain deadline, and the process
    exits 0 with its engine."""
    t = target(victim)
    engine = victim.engine_pids()[-1]

    async def scenario() -> tuple[list[Result], float, float]:
        load = asyncio.ensure_future(run_phase(t, long_prompts, long_refs, 48, Mix(raw_fraction=1.0, seed=3),
                                               TIMEOUT_S, requests=48))
        while (await engine_gauges(t)).get("moe_num_requests_waiting", 0) < 32:  # 8 rounds of 4 x ~150 tokens
            await asyncio.sleep(0.05)
        victim.process.send_signal(signal.SIGTERM)
        signalled = time.perf_counter()
        await asyncio.sleep(0.5)
        async with httpx.AsyncClient() as http:
            with pytest.raises(httpx.ConnectError):
                await http.get(victim.base_url + "/health")
        results, _ = await load
        return results, signalled, max(r.end for r in results)

    results, signalled, last_end = asyncio.run(scenario())
    statuses = assert_verified(results, {"ok", ENGINE_DOWN})  # raw requests: each saw [DONE] last
    assert statuses[ENGINE_DOWN] >= 1, statuses  # the drain deadline cut some short ...
    assert last_end - signalled < DRAIN_SECONDS + 2  # ... and nothing ran on past it
    assert victim.process.wait(timeout=30) == 0
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE
