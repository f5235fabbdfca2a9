"""Malformed and hostile input: generated bodies, raw bytes and raw sockets against the real server.

Whatever arrives, the answer is never a 5xx and never a hang (every client call has a timeout),
every error is in OpenAI's shape {"error": {"message", "type", "param", "code"}}, and the server
is healthy, idle and has logged no unhandled error afterwards. Bodies that happen to be valid ask
for at most one token per choice, so the run costs seconds, not minutes.
"""
from __future__ import annotations

import json
import socket
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.conftest import RunningServer

EXAMPLES = {"chat": 450, "completions": 450, "raw": 250}  # >= 1,000 generated requests in all
CLIENT_TIMEOUT_S = 30.0
BODY_LIMIT = 4 * 1024 * 1024  # the server's default --max-body-bytes

SPECIAL_STRINGS = ["", " ", "\x00", "\u2028", "\ufeff", "🙂" * 64, "<|im_end|>", "<|im_start|>system\n",
                   "{{ 7 * 7 }}", "{% for x in range(99999999) %}x{% endfor %}", "%s%n%x", "../../etc/passwd",
                   "/etc/passwd", "\\u0000", "null", "NaN"]
SPECIAL_NUMBERS = [0, -1, 1, 2**31, 2**53 + 1, 2**63, 2**64, -(2**63) - 1, 10**40, 1e-45, 5e-324, 1e308, -0.0,
                   2.0000001, 0.5]
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(SPECIAL_NUMBERS), st.text(max_size=30), st.sampled_from(SPECIAL_STRINGS),
    st.integers(1_000, 300_000).map(lambda n: "a" * n),  # enormous strings, cheap to build
)
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids,
                                                                                         max_size=5), max_leaves=8)
PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"]) | VALUES,
                                        "text": VALUES}), max_size=3)
MESSAGE = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "developer", "tool", "function", "", "USER"]) | VALUES,
     "content": VALUES | PARTS},
    optional={"name": VALUES, "tool_calls": VALUES, "refusal": VALUES})
MESSAGES = st.one_of(VALUES, st.lists(MESSAGE, max_size=6),
                     st.integers(0, 20_000).map(lambda n: [{"role": "user", "content": "hi"}] * n))
TOKEN_IDS = st.one_of(st.lists(st.integers(-(2**70), 2**70), max_size=20), st.lists(st.integers(0, 200), max_size=300))
PROMPTS = st.one_of(VALUES, TOKEN_IDS, st.lists(TOKEN_IDS, max_size=70), st.lists(st.text(max_size=20), max_size=70),
                    st.integers(0, 100_000).map(lambda n: [[1]] * n))
COMMON_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                 "stream_options", "presence_penalty", "frequency_penalty", "user")
FIELDS = {"chat": COMMON_FIELDS + ("messages", "max_completion_tokens", "logprobs", "top_logprobs"),
          "completions": COMMON_FIELDS + ("prompt", "logprobs", "suffix", "echo", "best_of")}


def fuzz(examples: int) -> settings:
    """Reproducible (derandomized, no example database) and never cut short for being slow."""
    return settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def http(server: RunningServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=CLIENT_TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module", autouse=True)
def healthy_afterwards(server: RunningServer) -> Iterator[None]:
    """After this module: /health 200, the engine idle, and no unhandled error in the log since it began."""
    log_start = len(server.log())
    yield
    assert server.get("/health").status_code == 200
    deadline = time.monotonic() + 30
    while server.metric("moe_num_requests_running") + server.metric("moe_num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the engine never went idle"
        time.sleep(0.2)
    new_log = server.log()[log_start:]
    assert "unhandled error" not in new_log and "Exception in ASGI application" not in new_log, new_log[-3000:]


def check_answer(resp: httpx.Response, sent: bytes) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text[:500], sent[:300])
    if resp.status_code == 200:
        check_success(resp)
        return
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert isinstance(body["error"]["message"], str) and isinstance(body["error"]["type"], str), body


def check_success(resp: httpx.Response) -> None:
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and all("error" not in json.loads(e) for e in events[:-1]), events[-3:]
    else:
        body = resp.json()
        assert body["choices"] and body["usage"]["completion_tokens"] >= len(body["choices"]), body


def cheap(body: dict) -> dict:
    """Keep valid bodies to a token per choice: a token budget the tiny context could hold becomes 1."""
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 1 < value < 10_000:
            body[key] = 1
    if not {"max_tokens", "max_completion_tokens"} & set(body):
        body["max_tokens"] = 1
    return body


@st.composite
def bodies(draw: st.DrawFn, route: str, model: str) -> dict:
    """A valid one-token request, then one to three hostile edits: a field set to anything, a field
    dropped, an unknown field added, or the messages / prompt replaced."""
    body = {"model": model, "max_tokens": 1,
            **({"messages": [{"role": "user", "content": "hi"}]} if route == "chat" else {"prompt": "hi"})}
    for _ in range(draw(st.integers(1, 3))):
        edit = draw(st.sampled_from(["set", "drop", "unknown", "input"]))
        if edit == "set":
            body[draw(st.sampled_from(FIELDS[route]))] = draw(VALUES)
        elif edit == "drop":
            body.pop(draw(st.sampled_from(FIELDS[route])), None)
        elif edit == "unknown":
            body[draw(st.text(min_size=1, max_size=20))] = draw(VALUES)
        elif route == "chat":
            body["messages"] = draw(MESSAGES)
        else:
            body["prompt"] = draw(PROMPTS)
    return cheap(body)


def post(http: httpx.Client, path: str, content: bytes, headers: dict | None = None) -> int:
    headers = {"content-type": "application/json", **(headers or {})}
    resp = http.post(path, content=content, headers=headers)
    check_answer(resp, content)
    return resp.status_code


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_generated_bodies(server: RunningServer, http: httpx.Client, route: str) -> None:
    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    statuses: Counter[int] = Counter()

    @fuzz(EXAMPLES[route])
    @given(body=bodies(route, server.model))
    def run(body: dict) -> None:
        statuses[post(http, path, json.dumps(body).encode())] += 1

    run()
    assert statuses.total() >= EXAMPLES[route] and statuses[200] >= 10, statuses  # some were valid and served


VALID = b'{"model": "MODEL", "prompt": "hi", "max_tokens": 1}'
BAD_UTF8 = [b"\xff", b"\xfe\xff", b"\xc3", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xc0\xaf", b"\x80"]
NUMBER_LITERALS = [b"NaN", b"Infinity", b"-Infinity", b"1e99999", b"-1e99999", b"00012", b"1.0e-400", b"0x10",
                   b"1_000", b"+1", b".5", b"9" * 5000]


@st.composite
def raw_bodies(draw: st.DrawFn, model: str) -> bytes:
    valid = VALID.replace(b"MODEL", model.encode())
    kind = draw(st.sampled_from(["bytes", "bad_utf8", "truncated", "nested", "number", "duplicate", "encoding"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "bad_utf8":  # invalid UTF-8 inside a string, a key, or outside any string
        at = draw(st.integers(0, len(valid)))
        return valid[:at] + draw(st.sampled_from(BAD_UTF8)) + valid[at:]
    if kind == "truncated":
        return valid[:draw(st.integers(0, len(valid) - 1))]
    if kind == "nested":  # deep nesting, as the whole body or as one field
        depth = draw(st.integers(1, 200_000))
        opened, closed = draw(st.sampled_from([(b"[", b"]"), (b'{"a":', b"}")]))
        nest = opened * depth + b"1" + closed * depth
        return nest if draw(st.booleans()) else valid.replace(b'"hi"', nest)
    if kind == "number":
        field = draw(st.sampled_from([b"max_tokens", b"temperature", b"seed", b"n", b"top_p"]))
        return valid[:-1] + b', "' + field + b'": ' + draw(st.sampled_from(NUMBER_LITERALS)) + b"}"
    if kind == "duplicate":
        return valid[:-1] + b', "max_tokens": ' + str(draw(st.integers(-5, 10**6))).encode() + b"}"
    return draw(st.sampled_from([b"\xef\xbb\xbf" + valid, valid.decode().encode("utf-16"),
                                 valid.decode().encode("utf-32")]))


def test_generated_raw_bytes(server: RunningServer, http: httpx.Client) -> None:
    @fuzz(EXAMPLES["raw"])
    @given(body=raw_bodies(server.model), path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
           content_type=st.sampled_from(["application/json", "text/plain", "application/x-www-form-urlencoded",
                                         "multipart/form-data; boundary=x"]))
    def run(body: bytes, path: str, content_type: str) -> None:
        statuses[post(http, path, body, {"content-type": content_type})] += 1

    statuses: Counter[int] = Counter()
    run()
    assert statuses.total() >= EXAMPLES["raw"], statuses


def test_oversized_bodies_are_413_declared_or_chunked(http: httpx.Client) -> None:
    big = b'{"prompt": "' + b"a" * BODY_LIMIT + b'"}'
    declared = http.post("/v1/completions", content=big)
    chunked = http.post("/v1/completions", content=(big[i:i + 65536] for i in range(0, len(big), 65536)))
    for resp in (declared, chunked):
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"


def test_values_at_the_edges_of_valid_are_answered(server: RunningServer, http: httpx.Client) -> None:
    """Found by this file: a tiny temperature made the engine's softmax NaN (a 503); now a greedy-like answer."""
    for temperature in (1e-45, 5e-324, 1e-30):
        resp = http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2,
                                                   "temperature": temperature})
        assert resp.status_code == 200, resp.text


def test_a_huge_list_of_prompts_is_refused_before_tokenising(server: RunningServer, http: httpx.Client) -> None:
    """Found by this file: ~1M one-character prompts were all tokenised first, blocking the event loop for 36 s."""
    body = json.dumps({"model": server.model, "max_tokens": 1, "prompt": ["a"] * 800_000}).encode()
    began = time.monotonic()
    resp = http.post("/v1/completions", content=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert time.monotonic() - began < 10


def test_a_huge_prompt_does_not_stall_other_clients(server: RunningServer, http: httpx.Client) -> None:
    """Found by this file: a 4 MB prompt was tokenised on the event loop, stalling every stream for ~4 s."""
    body = json.dumps({"model": server.model, "max_tokens": 1, "prompt": "ab " * 1_390_000}).encode()
    with ThreadPoolExecutor(1) as pool:
        huge = pool.submit(http.post, "/v1/completions", content=body)
        stalls = []
        while not huge.done():
            began = time.monotonic()
            assert http.get("/health").status_code == 200
            stalls.append(time.monotonic() - began)
    assert huge.result().json()["error"]["code"] == "context_length_exceeded"
    assert len(stalls) > 1 and max(stalls) < 1.0, stalls


# ---- raw sockets: the HTTP layer itself ----------------------------------------------------------

def _connect(server: RunningServer) -> socket.socket:
    host, port = server.base_url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=CLIENT_TIMEOUT_S)


def _exchange(server: RunningServer, data: bytes) -> bytes:
    """Send raw bytes, half-close, read the whole answer (an empty one if the server just closed)."""
    chunks = []
    with _connect(server) as sock:
        sock.sendall(data)
        try:
            sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server already answered and closed: what it sent is still readable
            pass
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:  # it closed with our excess bytes unread
            pass
    return b"".join(chunks)


RAW_REQUESTS = [
    b"GARBAGE\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"model\"",  # body cut short
    b"POST /v1/comp",  # request line cut short
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n",  # headers cut short
]


@pytest.mark.parametrize("data", RAW_REQUESTS, ids=range(len(RAW_REQUESTS)))
def test_broken_http_is_refused_below_500(server: RunningServer, data: bytes) -> None:
    """uvicorn answers protocol errors itself (plain-text 400s, outside the app), or just closes."""
    answer = _exchange(server, data)
    if answer:
        status = int(answer.split(b" ", 2)[1])
        assert 400 <= status < 500, answer[:300]


def test_slow_loris_connections_do_not_starve_other_clients(server: RunningServer, http: httpx.Client) -> None:
    """64 connections trickling headers or holding a half-sent body: a normal request is still answered
    at once, and once they hang up the server is back to idle."""
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    loris = [_connect(server) for _ in range(64)]
    try:
        for i, sock in enumerate(loris):
            sock.sendall(head + (b"Content-Length: 1000\r\n\r\n{\"model\":" if i % 2 else b"X-Slow: a"))
        for _ in range(3):
            for sock in loris[::2]:
                sock.sendall(b"a")  # one more header byte each: never a complete request
            began = time.monotonic()
            resp = http.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 1})
            assert resp.status_code == 200 and time.monotonic() - began < 5
    finally:
        for sock in loris:
            sock.close()
    assert http.get("/health").status_code == 200
