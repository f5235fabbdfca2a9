"""Killing the engine process: in-flight requests fail cleanly, /health goes 503, the engine comes back."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from tests.server.conftest import REPO, RunningServer, start_server


@pytest.fixture(scope="module")
def victim(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    running = start_server(tiny_model, tmp_path_factory.mktemp("logs"), "--enable-log-requests")  # see "2 choices"
    yield running
    running.stop()


STREAM_CHOICES = 8  # ~1200 tokens under this seed: seconds of engine work, so the kill lands mid-stream


def _finished(server: RunningServer, reason: str) -> float:
    return server.metric(f'moe_requests_total{{finish_reason="{reason}"}}')


def _stream_events(server: RunningServer, started: threading.Event, events: list[str]) -> None:
    body = {"model": server.model, "prompt": "hello", "max_tokens": 240, "n": STREAM_CHOICES, "seed": 8,
            "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
                started.set()


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_health_is_503_until_the_engine_is_ready(victim: RunningServer) -> None:
    log = victim.log()  # start_server polled /health from the moment the port opened
    assert log.index('"GET /health HTTP/1.1" 503') < log.index("engine ready") < log.index('"GET /health HTTP/1.1" 200')


def test_killed_engine_fails_in_flight_requests_and_comes_back(victim: RunningServer) -> None:
    [old_pid] = victim.engine_pids()
    finished_before = sum(_finished(victim, r) for r in ("stop", "length", "error"))
    started, events, plain = threading.Event(), [], []
    streamer = threading.Thread(target=_stream_events, args=(victim, started, events))
    waiter = threading.Thread(target=lambda: plain.append(victim.post(
        "/v1/completions", json={"model": victim.model, "prompt": "hi", "max_tokens": 240, "n": 2})))
    streamer.start()
    assert started.wait(30)
    waiter.start()
    _wait_for(lambda: "2 choices" in victim.log())  # the second request reached the engine queue
    os.kill(old_pid, signal.SIGKILL)
    streamer.join(30)
    waiter.join(30)

    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "engine_unavailable"
    assert plain[0].status_code == 503 and plain[0].json()["error"]["type"] == "server_error"

    assert victim.get("/health").status_code == 503
    down = victim.post("/v1/completions", json={"model": victim.model, "prompt": "hi", "max_tokens": 2})
    assert down.status_code == 503 and down.headers["retry-after"] == "1"

    # every choice is accounted for; the waiter's two and the stream's unfinished ones as errors
    assert sum(_finished(victim, r) for r in ("stop", "length", "error")) == finished_before + STREAM_CHOICES + 2
    assert _finished(victim, "error") >= 3

    victim.wait_healthy(120)
    [_, new_pid] = victim.engine_pids()
    assert new_pid != old_pid
    again = victim.post("/v1/completions", json={"model": victim.model, "prompt": "hi", "max_tokens": 3})
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("api_servers", ["1", "2"])
def test_engine_that_cannot_start_stops_the_server(tmp_path: Path, tiny_model: Path, api_servers: str) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    # passes every start-up check (config, tokenizer, a weights file); only loading finds the tensor unknown
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((tiny_model / name).read_bytes())
    save_file({"not.a.weight": torch.zeros(1)}, str(broken / "model.safetensors"))
    with pytest.raises(RuntimeError, match="server exited with 1"):
        start_server(broken, tmp_path, "--api-server-count", api_servers)
    log = next(tmp_path.glob("server-*.log")).read_text()
    assert "the engine could not start" in log


def test_missing_model_directory_is_a_clean_error(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "moe_serve.server", "--model", str(tmp_path / "nope")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1 and "no such folder" in done.stderr
