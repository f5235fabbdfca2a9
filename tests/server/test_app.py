"""The app's own surface, without an engine: CORS (default off, then an allowed origin), the 404 that
names an unknown route, /version, and the system fingerprint."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from moe_serve.engine.config import EngineConfig
from moe_serve.server.app import PACKAGE_VERSION, create_app, system_fingerprint
from moe_serve.server.cli import parse_args, server_settings_from_args
from moe_serve.server.response_store import StoredResponse
from moe_serve.server.settings import ServerSettings

ALLOWED = "http://localhost:3000"
PREFLIGHT = {"access-control-request-method": "POST", "access-control-request-headers": "authorization,content-type"}


def client(tiny_model: Path, **settings) -> TestClient:
    """No `with`: the lifespan (the engine process) never starts, which none of these routes needs."""
    return TestClient(create_app(ServerSettings(served_model_name="tiny", **settings),
                                 EngineConfig(model=str(tiny_model))))


def test_cors_is_off_by_default_and_says_so(tiny_model: Path) -> None:
    resp = client(tiny_model).options("/v1/chat/completions", headers={"origin": ALLOWED, **PREFLIGHT})
    assert resp.status_code == 400 and "access-control-allow-origin" not in resp.headers
    error = resp.json()["error"]
    assert error["code"] == "cors_disallowed"
    assert "origin" in error["message"] and "--allowed-origins" in error["message"]
    assert "access-control-allow-origin" not in client(tiny_model).get("/version", headers={"origin": ALLOWED}).headers


def test_an_allowed_origin_passes_preflight_and_reads_answers(tiny_model: Path) -> None:
    app = client(tiny_model, allowed_origins=(ALLOWED,))
    resp = app.options("/v1/chat/completions", headers={"origin": ALLOWED, **PREFLIGHT})
    assert resp.status_code == 200 and resp.headers["access-control-allow-origin"] == ALLOWED
    assert "authorization" in resp.headers["access-control-allow-headers"].lower()
    assert app.get("/version", headers={"origin": ALLOWED}).headers["access-control-allow-origin"] == ALLOWED
    other = app.options("/v1/chat/completions", headers={"origin": "http://evil.example", **PREFLIGHT})
    assert other.status_code == 400 and other.json()["error"]["code"] == "cors_disallowed"


def test_cors_methods_and_headers_narrow_what_an_allowed_origin_may_send(tiny_model: Path) -> None:
    app = client(tiny_model, allowed_origins=(ALLOWED,), allowed_methods=("GET",), allowed_headers=("content-type",))
    resp = app.options("/v1/chat/completions", headers={"origin": ALLOWED, **PREFLIGHT})
    assert resp.status_code == 400 and "method" in resp.json()["error"]["message"]


@pytest.mark.parametrize("method, path", [("GET", "/v1/nope"), ("POST", "/v1/chat/completion"), ("GET", "/")])
def test_an_unknown_route_is_named_in_its_404(tiny_model: Path, method: str, path: str) -> None:
    resp = client(tiny_model).request(method, path)
    assert resp.status_code == 404
    assert resp.json()["error"] == {"message": f"no route {method} {path}", "type": "invalid_request_error",
                                    "param": None, "code": "not_found"}


def test_version(tiny_model: Path) -> None:
    assert client(tiny_model).get("/version").json() == {"version": PACKAGE_VERSION}


def test_system_fingerprint_follows_the_engine_settings(tiny_model: Path) -> None:
    config = EngineConfig(model=str(tiny_model))
    assert system_fingerprint(config) == system_fingerprint(EngineConfig(model=str(tiny_model)))
    assert system_fingerprint(config) != system_fingerprint(replace(config, dtype="bfloat16"))
    assert system_fingerprint(config).startswith("fp_")


def test_cors_flags_reach_the_settings(tiny_model: Path) -> None:
    args = parse_args([str(tiny_model), "--allowed-origins", f"{ALLOWED}, https://chat.example",
                       "--allowed-headers", "authorization,content-type"])
    settings = server_settings_from_args(args)
    assert settings.allowed_origins == (ALLOWED, "https://chat.example")
    assert settings.allowed_headers == ("authorization", "content-type") and settings.allowed_methods == ("*",)
    assert server_settings_from_args(parse_args([str(tiny_model)])).allowed_origins == ()
    with pytest.raises(SystemExit):
        parse_args([str(tiny_model), "--allowed-origins", "['http://a']"])  # a YAML list, as --config passes it


def test_apps_given_one_response_store_path_share_their_stored_responses(tiny_model: Path, tmp_path: Path) -> None:
    """--api-server-count: a GET lands on whichever API server process accepted it, not the one that stored."""
    path = str(tmp_path / "responses.sqlite3")
    storing, other = (client(tiny_model, response_store_path=path) for _ in range(2))
    apart = client(tiny_model)
    body = {"id": "resp_1", "object": "response", "status": "completed", "output": []}
    storing.app.state.responses.put(StoredResponse(body, ({"role": "user", "content": "hi"},)))
    assert storing.get("/v1/responses/resp_1").json() == other.get("/v1/responses/resp_1").json() == body
    missing = apart.get("/v1/responses/resp_1")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
