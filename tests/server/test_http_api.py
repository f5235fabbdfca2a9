"""Raw HTTP against the shared server: SSE framing, every error case, disconnects, the edges of the API."""
from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_serve.server.errors import UNSUPPORTED_FIELDS
from tests.server.conftest import MAX_MODEL_LEN, RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat_body(server: RunningServer, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **fields}


def assert_error(resp: httpx.Response, status: int, param: str | None = None, *words: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    for word in words:
        assert word in error["message"], error
    return error


def sse_events(text: str) -> list[str]:
    """The data payloads of an SSE body, checking the framing on the way."""
    blocks = [b for b in text.replace("\r\n", "\n").split("\n\n") if b.strip()]
    data = []
    for block in blocks:
        lines = [ln for ln in block.split("\n") if not ln.startswith(":")]  # ':' lines are keep-alive comments
        assert all(ln.startswith("data: ") for ln in lines), block
        data.extend(ln[len("data: "):] for ln in lines)
    return data


def test_health_and_models(server: RunningServer) -> None:
    assert server.get("/health").json() == {"status": "ok"}
    body = server.get("/v1/models").json()
    assert body["object"] == "list" and body["data"][0]["id"] == server.model
    assert body["data"][0]["max_model_len"] == MAX_MODEL_LEN


def test_sse_framing(server: RunningServer) -> None:
    resp = server.post(CHAT, json=chat_body(server, stream=True, stream_options={"include_usage": True}))
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    *chunks, done = sse_events(resp.text)
    assert done == "[DONE]"
    parsed = [json.loads(c) for c in chunks]
    assert len({(p["id"], p["created"], p["model"]) for p in parsed}) == 1
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] >= 1


def test_completion_stream_equals_non_stream(server: RunningServer) -> None:
    body = {"model": server.model, "prompt": "hello", "max_tokens": 12, "seed": 3}
    plain = server.post(COMPLETIONS, json=body).json()
    events = sse_events(server.post(COMPLETIONS, json={**body, "stream": True}).text)
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert streamed == plain["choices"][0]["text"]


def test_by_default_an_access_line_per_response_and_no_request_line(server: RunningServer) -> None:
    """Request lines are vLLM's opt-in (--enable-log-requests): each costs the one event loop."""
    resp = server.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200
    log = server.log()
    assert f"{resp.json()['id']}: " not in log and '"POST /v1/completions HTTP/1.1" 200' in log


def test_form_encoded_content_type_is_still_json(server: RunningServer) -> None:
    """`curl -d '{...}'` sends application/x-www-form-urlencoded."""
    resp = server.post(CHAT, content=json.dumps(chat_body(server)),
                       headers={"content-type": "application/x-www-form-urlencoded"})
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("raw", [b'{"model": "x", "messages": [', b"not json", b""])
def test_malformed_json_is_400(server: RunningServer, raw: bytes) -> None:
    error = assert_error(server.post(CHAT, content=raw), 400, None)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": 3}, "temperature"),
    ({"n": 0}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": []}, "messages"),
    ({"stop": 5}, "stop"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"max_tokens": 3, "max_completion_tokens": 3}, "max_tokens"),
])
def test_wrong_types_and_values_are_400_naming_the_field(server: RunningServer, fields: dict, param: str) -> None:
    assert_error(server.post(CHAT, json=chat_body(server, **fields)), 400, param)


def test_missing_fields_are_400(server: RunningServer) -> None:
    assert_error(server.post(CHAT, json={"model": server.model}), 400, "messages", "missing")
    assert_error(server.post(COMPLETIONS, json={"prompt": "x"}), 400, "model", "missing")


@pytest.mark.parametrize("field", sorted(UNSUPPORTED_FIELDS))
def test_unsupported_openai_fields_are_rejected_by_name(server: RunningServer, field: str) -> None:
    error = assert_error(server.post(CHAT, json=chat_body(server, **{field: None})), 400, field, field)
    assert error["code"] == "unsupported_parameter"


def test_unknown_fields_are_rejected_by_name(server: RunningServer) -> None:
    assert_error(server.post(CHAT, json=chat_body(server, temprature=0.5)), 400, "temprature", "temprature")
    body = chat_body(server, messages=[{"role": "user", "content": "hi", "nickname": "bob"}])
    assert_error(server.post(CHAT, json=body), 400, "messages.0.nickname")
    assert_error(server.post(COMPLETIONS, json={"model": server.model, "prompt": "x", "best_of": 2}), 400, "best_of")


def test_unknown_model_is_404(server: RunningServer) -> None:
    error = assert_error(server.post(CHAT, json=chat_body(server, model="gpt-4")), 404, "model", "gpt-4")
    assert error["code"] == "model_not_found"


def test_max_tokens_below_one_is_400(server: RunningServer) -> None:
    assert_error(server.post(CHAT, json=chat_body(server, max_tokens=0)), 400, "max_tokens", "at least 1")
    assert_error(server.post(CHAT, json=chat_body(server, max_completion_tokens=-3)), 400, "max_tokens")


def test_context_overflow_is_400_with_the_numbers(server: RunningServer) -> None:
    body = {"model": server.model, "prompt": [5] * 200, "max_tokens": 100}
    error = assert_error(server.post(COMPLETIONS, json=body), 400, "max_tokens", str(MAX_MODEL_LEN), "200", "100", "300")
    assert error["code"] == "context_length_exceeded"
    long_prompt = {"model": server.model, "prompt": [5] * MAX_MODEL_LEN}
    assert_error(server.post(COMPLETIONS, json=long_prompt), 400, None, str(MAX_MODEL_LEN))


def test_token_ids_outside_the_vocabulary_are_400(server: RunningServer) -> None:
    body = {"model": server.model, "prompt": [1, 100000], "max_tokens": 2}
    assert_error(server.post(COMPLETIONS, json=body), 400, "prompt", "100000")


def test_oversized_body_is_413(server: RunningServer) -> None:
    huge = {"model": server.model, "prompt": "x" * (4 * 1024 * 1024 + 1)}
    assert_error(server.post(COMPLETIONS, json=huge), 413, None)

    def chunks():  # no Content-Length: the limit is enforced as the body streams in
        yield b'{"model": "m", "prompt": "'
        for _ in range(5):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    assert_error(server.post(COMPLETIONS, content=chunks()), 413, None)


def test_unknown_route_is_404_in_the_error_shape(server: RunningServer) -> None:
    assert_error(server.post("/v1/embeddings", json={}), 404, None)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options",
          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "user", "messages", "prompt",
          "model", "max_completion_tokens", "tools", "tool_choice", "parallel_tool_calls", "zzz"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from([CHAT, COMPLETIONS]), fields=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=3))
def test_fuzzed_bodies_never_get_a_5xx(server: RunningServer, path: str, fields: dict) -> None:
    body = {"model": server.model, "max_tokens": 3, **({"messages": [{"role": "user", "content": "hi"}]}
                                                        if path == CHAT else {"prompt": "hi"}), **fields}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3  # keep the valid ones quick
    resp = server.post(path, json=body)
    assert resp.status_code in (200, 400, 404), resp.text
    if resp.status_code != 200:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_no_api_key_configured_means_open(server: RunningServer) -> None:
    assert server.post(CHAT, json=chat_body(server), headers={"authorization": "Bearer anything"}).status_code == 200
    assert server.post(CHAT, json=chat_body(server)).status_code == 200


def _settled_decoded_tokens(server: RunningServer, quiet: float = 1.5, timeout: float = 30.0) -> float:
    """Engine-side count of decoded tokens (one TPOT sample each), once it stopped moving."""
    deadline = time.monotonic() + timeout
    last, since = server.metric("moe_time_per_output_token_seconds_count"), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = server.metric("moe_time_per_output_token_seconds_count")
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    raise AssertionError("the engine kept decoding")


def _assert_engine_idle(server: RunningServer) -> None:
    assert server.metric("moe_num_requests_running") == 0
    assert server.metric("moe_num_requests_waiting") == 0


# Eight choices decoded together: ~0.5 s of engine work on a 2-core CPU, deterministic under the
# seed (the tiny random model often samples EOS early, so a single choice can end too soon).
LONG_JOB = {"prompt": "hello", "max_tokens": 240, "n": 8, "seed": 8}


@pytest.fixture(scope="module")
def long_job_tokens(server: RunningServer) -> int:
    """Tokens the engine decodes for LONG_JOB when nobody hangs up."""
    total = server.post(COMPLETIONS, json={"model": server.model, **LONG_JOB}).json()["usage"]["completion_tokens"]
    assert total > 600, f"LONG_JOB is too short ({total} tokens); pick another seed"
    return total


def test_stream_disconnect_frees_the_engine(server: RunningServer, long_job_tokens: int) -> None:
    before = _settled_decoded_tokens(server)
    aborts = server.metric('moe_requests_total{finish_reason="abort"}')
    with httpx.stream("POST", server.base_url + COMPLETIONS, json={"model": server.model, "stream": True, **LONG_JOB},
                      timeout=30) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                break  # the first event arrived: hang up
    assert _settled_decoded_tokens(server) - before < long_job_tokens / 2
    _assert_engine_idle(server)
    assert server.metric('moe_requests_total{finish_reason="abort"}') > aborts


def test_non_stream_disconnect_frees_the_engine(server: RunningServer, long_job_tokens: int) -> None:
    before = _settled_decoded_tokens(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + COMPLETIONS, json={"model": server.model, **LONG_JOB}, timeout=0.1)
    assert _settled_decoded_tokens(server) - before < long_job_tokens / 2
    _assert_engine_idle(server)
