"""A server configured from YAML + env + flags: API key, protected /metrics, queue limit, caps, log lines."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.server.conftest import RunningServer, start_server

KEY = "sekret-key"
AUTH = {"authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def strict(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    config = tmp_path_factory.mktemp("cfg") / "strict.yaml"
    config.write_text(yaml.safe_dump({"served-model-name": "tiny-strict", "max-queue": 50, "max-tokens-cap": 200,
                                      "metrics-require-key": True, "max-body-bytes": 4096,
                                      "enable-log-requests": True, "disable-uvicorn-access-log": True}))
    # --max-queue on the command line must win over the file's 50
    running = start_server(tiny_model, tmp_path_factory.mktemp("logs"), "--config", str(config), "--max-queue", "2",
                           env={"MOE_API_KEY": KEY})
    running.model = "tiny-strict"
    yield running
    running.stop()


def body(strict: RunningServer, **fields) -> dict:
    return {"model": strict.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"authorization": KEY},
                                     {"authorization": f"Basic {KEY}"}])
def test_missing_or_bad_key_is_401(strict: RunningServer, headers: dict) -> None:
    for resp in (strict.post("/v1/chat/completions", json=body(strict), headers=headers),
                 strict.post("/v1/completions", json={"model": strict.model, "prompt": "x"}, headers=headers),
                 strict.get("/v1/models", headers=headers), strict.get("/metrics", headers=headers)):
        assert resp.status_code == 401, resp.text
        assert resp.json()["error"]["code"] == "invalid_api_key"


def test_the_key_is_never_logged(strict: RunningServer) -> None:
    assert KEY not in strict.log()


def test_sdk_with_the_key(strict: RunningServer) -> None:
    client = openai.OpenAI(base_url=strict.base_url + "/v1", api_key=KEY, max_retries=0)
    resp = client.chat.completions.create(model="tiny-strict", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=3)
    assert resp.usage.completion_tokens >= 1
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=strict.base_url + "/v1", api_key="nope", max_retries=0).models.list()


def test_a_line_per_request_and_no_access_log_when_asked(strict: RunningServer) -> None:
    resp = strict.post("/v1/chat/completions", json=body(strict), headers=AUTH)
    assert resp.status_code == 200
    log = strict.log()
    assert f"{resp.json()['id']}: " in log and "prompt tokens" in log
    assert '"POST /v1/chat/completions' not in log


def test_health_open_metrics_need_the_key(strict: RunningServer) -> None:
    assert strict.get("/health").status_code == 200
    resp = strict.get("/metrics", headers=AUTH)
    assert resp.status_code == 200 and "moe_requests_total" in resp.text


def test_yaml_settings_apply(strict: RunningServer) -> None:
    assert strict.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "tiny-strict"
    over_cap = strict.post("/v1/chat/completions", json=body(strict, max_tokens=201), headers=AUTH)
    assert over_cap.status_code == 400 and "200" in over_cap.json()["error"]["message"]
    too_big = strict.post("/v1/completions", json={"model": strict.model, "prompt": "x" * 5000}, headers=AUTH)
    assert too_big.status_code == 413


def test_full_queue_is_429_with_retry_after(strict: RunningServer) -> None:
    first_event = threading.Event()
    release = threading.Event()

    def hold_two_slots() -> None:  # n=2 streaming: two engine requests in flight for ~400 tokens
        # seeds 12 and 13 run to max_tokens on the tiny model (no early EOS), so the slots stay taken
        job = {"model": strict.model, "prompt": "hello", "max_tokens": 200, "n": 2, "seed": 12, "stream": True}
        with httpx.stream("POST", strict.base_url + "/v1/completions", headers=AUTH, timeout=60, json=job) as resp:
            for _ in resp.iter_lines():
                first_event.set()
                if release.wait(0):
                    break

    holder = threading.Thread(target=hold_two_slots)
    holder.start()
    try:
        assert first_event.wait(30)
        busy = strict.post("/v1/chat/completions", json=body(strict), headers=AUTH)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "rate_limit_error"
    finally:
        release.set()
        holder.join(60)
    assert strict.post("/v1/chat/completions", json=body(strict), headers=AUTH).status_code == 200
