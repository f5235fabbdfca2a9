"""Security properties of moe-serve as tests: bind address, API key on every /v1 route (compared in
constant time, never logged), /health and /metrics exposure, size caps, no client control over what
is loaded, no remote code unless asked, and a non-root container."""
from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from moe_serve.engine.cli import engine_config_from_args
from moe_serve.engine.config import EngineConfig
from moe_serve.server.app import create_app
from moe_serve.server.cli import parse_args
from moe_serve.server.settings import ServerSettings
from moe_serve.server.tokenizer import Tokenizer
from tests.server.conftest import REPO, RunningServer, start_server

KEY = "sk-moe-7d1c0f5e9b2a4c83a6e1"
CAP_TOKENS, CAP_BYTES = 8, 65536
SERVER_SOURCES = sorted((REPO / "moe_serve" / "server").glob("*.py"))


@pytest.fixture(scope="module")
def keyed(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """The key given on the command line (the path most likely to leak it), /metrics behind it too; every
    log line a request can write is on."""
    running = start_server(tiny_model, tmp_path_factory.mktemp("logs"), "--api-key", KEY, "--metrics-require-key",
                           "--max-tokens-cap", str(CAP_TOKENS), "--max-body-bytes", str(CAP_BYTES),
                           "--enable-log-requests")
    yield running
    running.stop()


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _flatten(routes: list) -> Iterator:
    """Routes, with those of included routers (FastAPI wraps them) taken out of their wrapper."""
    for route in routes:
        inner = getattr(route, "original_router", None)
        yield from _flatten(inner.routes) if inner is not None else [route]


def v1_routes(tiny_model: Path) -> list[tuple[str, str]]:
    """Every (method, path) under /v1 the app serves, read from the app itself so a new route is covered."""
    app = create_app(ServerSettings(served_model_name="x"), EngineConfig(model=str(tiny_model)))
    routes = [(method, route.path_format) for route in _flatten(app.routes) if route.path.startswith("/v1")
              for method in sorted(route.methods or ()) if method != "HEAD"]
    assert {p for p in app.openapi()["paths"] if p.startswith("/v1")} == {path for _, path in routes}
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models")} <= set(routes)
    return routes


def test_default_bind_is_loopback(server: RunningServer) -> None:
    assert parse_args([]).host == "127.0.0.1"
    listening = [c.laddr for c in psutil.Process(server.process.pid).net_connections("inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening), listening


@pytest.mark.parametrize("headers", [{}, auth("wrong"), auth(KEY[:-1] + "x"), auth(KEY[:8]), auth(KEY + "x"),
                                     auth(KEY.upper()), {"authorization": KEY}, {"authorization": f"Basic {KEY}"},
                                     {"x-api-key": KEY}],
                         ids=["none", "wrong", "same-length", "prefix", "longer", "upper", "no-scheme", "basic",
                              "x-api-key"])
def test_every_v1_route_needs_the_key(keyed: RunningServer, tiny_model: Path, headers: dict) -> None:
    for method, path in v1_routes(tiny_model):
        resp = httpx.request(method, keyed.base_url + path, headers=headers, json={"model": keyed.model}, timeout=30)
        assert resp.status_code == 401, (method, path, resp.text)
        assert resp.json()["error"]["code"] == "invalid_api_key" and KEY not in resp.text


def test_docs_and_schema_are_not_served_behind_a_key(keyed: RunningServer) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        resp = httpx.get(keyed.base_url + path, timeout=30)
        assert resp.status_code == 404, (path, resp.status_code)


INPUTS = {"/v1/completions": {"prompt": "hi", "max_tokens": 1},
          "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
          "/v1/responses": {"input": "hi", "max_output_tokens": 1}}


def test_the_key_opens_every_v1_route(keyed: RunningServer, tiny_model: Path) -> None:
    for method, path in v1_routes(tiny_model):
        body = {"model": keyed.model, **INPUTS[path]} if method == "POST" else None
        resp = httpx.request(method, keyed.base_url + _existing(path, keyed), headers=auth(KEY), json=body, timeout=30)
        assert resp.status_code == 200, (method, path, resp.text)


def _existing(path: str, keyed: RunningServer) -> str:
    """path with its parameters filled in with things that exist: the model, a stored response."""
    if "{response_id}" in path:
        made = httpx.post(keyed.base_url + "/v1/responses", headers=auth(KEY), timeout=30,
                          json={"model": keyed.model, **INPUTS["/v1/responses"]})
        path = path.replace("{response_id}", made.json()["id"])
    return path.replace("{model_id}", keyed.model)


def _names(node: ast.AST) -> set[str]:
    return {n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, (ast.Name, ast.Attribute))}


def _key_comparisons(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[int]:
    """Lines where ==, != or `in` touches the API key, or a local name assigned from it."""
    keyish = {"api_key"} | {target.id for node in ast.walk(function) if isinstance(node, ast.Assign)
                            and "api_key" in _names(node.value) for target in node.targets
                            if isinstance(target, ast.Name)}
    return [node.lineno for node in ast.walk(function) if isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) for op in node.ops)
            and keyish & _names(node)]


def test_key_comparison_is_constant_time() -> None:
    """The key is checked with hmac.compare_digest, and no ==, != or `in` anywhere in moe_serve/server/ touches it."""
    trees = {source.name: ast.parse(source.read_text()) for source in SERVER_SOURCES}
    assert "compare_digest" in _names(trees["state.py"])
    for name, tree in trees.items():
        for function in ast.walk(tree):
            if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                assert _key_comparisons(function) == [], (name, function.name)


def test_health_and_metrics_are_open_by_default(server: RunningServer) -> None:
    assert server.get("/health").status_code == 200
    assert server.get("/metrics").status_code == 200


def test_metrics_require_key_closes_metrics_but_not_health(keyed: RunningServer) -> None:
    """/health stays open for load balancers and the Dockerfile's HEALTHCHECK; it says only ok or not."""
    health = keyed.get("/health")
    assert health.status_code == 200 and set(health.json()) == {"status"}
    assert keyed.get("/metrics").status_code == 401
    assert keyed.get("/metrics", headers=auth("wrong")).status_code == 401
    assert keyed.get("/metrics", headers=auth(KEY)).status_code == 200


def test_the_key_never_reaches_the_log(keyed: RunningServer) -> None:
    keyed.post("/v1/completions", headers=auth(KEY), json={"model": keyed.model, "prompt": "hi", "max_tokens": 1})
    keyed.post("/v1/completions", headers=auth(KEY + "-typo"), json={"model": keyed.model, "prompt": "hi"})
    keyed.get("/metrics", headers=auth(KEY))
    log = keyed.log()
    assert "completions HTTP/1.1\" 200" in log and "401" in log and "prompt tokens" in log  # logged, not the key
    assert KEY not in log


def test_body_size_and_max_tokens_are_capped(keyed: RunningServer) -> None:
    big = keyed.post("/v1/completions", headers=auth(KEY), json={"model": keyed.model, "prompt": "a" * CAP_BYTES})
    assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
    over = keyed.post("/v1/completions", headers=auth(KEY),
                      json={"model": keyed.model, "prompt": "hi", "max_tokens": CAP_TOKENS + 1})
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
    default = keyed.post("/v1/completions", headers=auth(KEY), json={"model": keyed.model, "prompt": "hi"})
    assert default.status_code == 200 and default.json()["usage"]["completion_tokens"] <= CAP_TOKENS


@pytest.mark.parametrize("model", ["{dir}", "/etc", "../tiny-moe", "{dir}/../tiny-moe", "file://{dir}",
                                   "hf://Qwen/Qwen3-30B-A3B"])
def test_the_model_field_names_the_served_model_never_a_path(server: RunningServer, model: str) -> None:
    resp = server.post("/v1/completions", json={"model": model.format(dir=server.model_dir), "prompt": "hi",
                                                "max_tokens": 1})
    assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("field", ["model_path", "download_dir", "revision", "trust_remote_code", "tokenizer",
                                   "chat_template", "chat_template_kwargs", "lora_path", "config"])
def test_no_field_can_point_at_files_or_code(server: RunningServer, field: str) -> None:
    resp = server.post("/v1/chat/completions", json={"model": server.model, field: str(server.model_dir),
                                                     "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == field


def test_weights_and_tokenizer_come_only_from_the_startup_directory() -> None:
    """Only moe_serve/server/tokenizer.py loads anything by path, and it is handed --model's directory at start-up."""
    loaders = [(source.name, node.lineno) for source in SERVER_SOURCES
               for node in ast.walk(ast.parse(source.read_text()))
               if isinstance(node, ast.Attribute) and node.attr in ("from_pretrained", "load_model", "build_runtime")]
    assert [name for name, _ in loaders] == ["tokenizer.py"], loaders


def test_trust_remote_code_is_off_unless_asked() -> None:
    assert engine_config_from_args(parse_args([])).trust_remote_code is False
    assert engine_config_from_args(parse_args(["--trust-remote-code"])).trust_remote_code is True


def test_a_checkpoint_with_custom_code_is_refused_by_default(tmp_path: Path, tiny_model: Path) -> None:
    marker = tmp_path / "remote-code-ran"
    (tmp_path / "evil.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
                                      "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    (tmp_path / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": [null, "evil.EvilTokenizer"]}}')
    (tmp_path / "tokenizer.json").write_bytes((tiny_model / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="custom code"):
        Tokenizer(str(tmp_path))
    assert not marker.exists()


def test_the_container_runs_as_a_non_root_user() -> None:
    users = [line.split()[1] for line in (REPO / "Dockerfile").read_text().splitlines()
             if line.strip().upper().startswith("USER ")]
    assert users and users[-1] not in ("root", "0") and not users[-1].startswith(("root:", "0:"))
