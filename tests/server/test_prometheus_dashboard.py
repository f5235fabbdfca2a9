"""A real Prometheus scrapes a real server under load; every PromQL query of the Grafana
dashboard must then return data, and the vllm: series must match their moe_ twins."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import yaml

from tests.server.conftest import REPO, RunningServer, free_port, start_server
from tests.server.test_metrics import SAME_VALUE

DASHBOARD = REPO / "moe_serve" / "configs" / "grafana" / "dashboards" / "moe-serve.json"
RATE_WINDOW = "30s"  # what Grafana's $__rate_interval becomes here: it spans the whole load
LOAD_SECONDS = 8.0


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(f"{p['title']} / {t['refId']}", t["expr"]) for p in panels for t in p["targets"]]


def _prometheus_binary() -> str:
    """The Debian package, installed when missing (the test skips, saying why, if that fails)."""
    if shutil.which("prometheus") is None and os.geteuid() == 0 and shutil.which("apt-get"):
        install = "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus"
        done = subprocess.run(install, shell=True, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode != 0:
            print(f"apt-get install prometheus failed: {done.stderr[-2000:]}")
    path = shutil.which("prometheus")
    if path is None:
        reason = "prometheus is not installed and could not be installed (needs root and apt-get)"
        print(reason)
        pytest.skip(reason)
    return path


@pytest.fixture(scope="module")
def busy_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """Self-speculation, half the experts resident and prefetching (the draft phase too, for every MoE
    layer: the cutoff is past the last), so every panel has something to show."""
    running = start_server(tiny_model, tmp_path_factory.mktemp("logs"), "--spec", "self",
                           "--gpu-expert-budget", "50%", "--prefetch", "next-layer", "--spec-cutoff", "64")
    yield running
    running.stop()


@pytest.fixture(scope="module")
def prometheus(busy_server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    binary = _prometheus_binary()
    root = tmp_path_factory.mktemp("prometheus")
    target = busy_server.base_url.removeprefix("http://")
    (root / "prometheus.yml").write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "moe-serve", "static_configs": [{"targets": [target]}]}],
    }))
    url = f"http://127.0.0.1:{free_port()}"
    with open(root / "prometheus.log", "wb") as log:
        process = subprocess.Popen([binary, f"--config.file={root / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={root / 'data'}",
                                    f"--web.listen-address={url.removeprefix('http://')}"],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_until(lambda: httpx.get(url + "/-/ready", timeout=2).status_code == 200, 60, root / "prometheus.log")
        yield url
    finally:
        process.terminate()
        process.wait(30)


def _wait_until(condition, timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if condition():
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(log.read_text()[-3000:] if log else "timed out")


def _drive_load(server: RunningServer) -> None:
    """Two clients, chat and completions, streamed and not, until LOAD_SECONDS have passed."""
    def client(k: int) -> None:
        deadline, i = time.monotonic() + LOAD_SECONDS, 0
        while time.monotonic() < deadline:
            i += 1
            if k == 0:
                body = {"model": server.model, "messages": [{"role": "user", "content": f"story {i}"}],
                        "max_tokens": 24, "seed": i, "stream": bool(i % 2)}
                assert server.post("/v1/chat/completions", json=body).status_code == 200
            else:
                body = {"model": server.model, "prompt": f"hello {i}", "max_tokens": 16, "n": 2, "seed": i}
                assert server.post("/v1/completions", json=body).status_code == 200

    with ThreadPoolExecutor(2) as pool:
        list(pool.map(client, range(2)))


def _query(prometheus: str, expr: str) -> list[dict]:
    resp = httpx.get(prometheus + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert resp["status"] == "success", (expr, resp)
    return resp["data"]["result"]


def test_every_dashboard_query_returns_data(busy_server: RunningServer, prometheus: str) -> None:
    _wait_until(lambda: _query(prometheus, 'up{job="moe-serve"} == 1'), 30)
    _drive_load(busy_server)
    served = busy_server.metric("moe_generation_tokens_total")
    # wait for a scrape taken after the load, so every rate window ends on it
    _wait_until(lambda: any(float(r["value"][1]) == served for r in _query(prometheus, "moe_generation_tokens_total")), 30)
    spec_ran = busy_server.metric("moe_spec_drafts_total") > 0
    queries = dashboard_queries()
    assert len(queries) >= 14
    for name, expr in queries:
        result = _query(prometheus, expr.replace("$__rate_interval", RATE_WINDOW))
        assert result, f"{name}: no data for {expr}"
        values = [float(r["value"][1]) for r in result]
        if "moe_spec_" in expr and not spec_ran:
            print(f"{name}: the engine ran no speculative rounds, so 0/0 = NaN is the right answer")
            continue
        assert any(math.isfinite(v) for v in values), f"{name}: only NaN/Inf for {expr}: {values}"


def _selector(sample: str | tuple, **labels: str) -> str:
    name, own = (sample, ()) if isinstance(sample, str) else sample
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in (*own, *labels.items())) + "}"


def test_vllm_names_reach_prometheus_beside_their_moe_twins(busy_server: RunningServer, prometheus: str) -> None:
    """What a vLLM dashboard or `vllm bench serve` reads: each vllm: series, labelled with the served
    model, equals its moe_ twin at the same instant, and vLLM-style PromQL answers."""
    _wait_until(lambda: _query(prometheus, 'up{job="moe-serve"} == 1'), 30)
    body = {"model": busy_server.model, "messages": [{"role": "user", "content": "twins"}], "max_tokens": 24,
            "seed": 3}
    assert busy_server.post("/v1/chat/completions", json=body).status_code == 200
    served = busy_server.metric("moe_generation_tokens_total")
    _wait_until(lambda: any(float(r["value"][1]) == served
                            for r in _query(prometheus, "moe_generation_tokens_total")), 30)
    model = {"model_name": busy_server.model, "engine": "0"}
    for moe, vllm in SAME_VALUE:
        # one expression, so both sides come from the same scrape
        expr = (f"{_selector(vllm, **model)} - ignoring(model_name, engine, finished_reason, finish_reason) "
                f"{_selector(moe)}")
        assert [float(r["value"][1]) for r in _query(prometheus, expr)] == [0.0], expr
    assert busy_server.metric("moe_spec_drafts_total") > 0, "the self-drafting server ran no speculative round"
    rate = f'{{model_name="{busy_server.model}"}}[{RATE_WINDOW}])'
    for expr in (f"histogram_quantile(0.5, sum by (le) (rate(vllm:inter_token_latency_seconds_bucket{rate}))",
                 f"histogram_quantile(0.9, sum by (le) (rate(vllm:time_to_first_token_seconds_bucket{rate}))",
                 (f"1 + rate(vllm:spec_decode_num_accepted_tokens_total{rate}"  # mean acceptance length
                  f" / rate(vllm:spec_decode_num_drafts_total{rate}")):
        values = [float(r["value"][1]) for r in _query(prometheus, expr)]
        assert values and all(math.isfinite(v) for v in values), (expr, values)
