"""The built wheel, installed as a user would, at the lowest versions pyproject.toml allows.

`pip wheel .` builds the package; a fresh virtual environment gets the README's CPU torch, then that
wheel (not an editable install) with every other direct dependency pinned to its lower bound. The
wheel must hold one namespaced package with the default model and the presets inside it, and a
bare `moe-serve`, run from outside the repository, must serve the default model: one chat
completion and one stream. A bound that does not resolve, import or serve fails here; only an
unreachable package index skips."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.server.conftest import REPO, RunningServer, free_port
from tests.server.test_http_api import CHAT, sse_events

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")

pytestmark = pytest.mark.timeout(900)

# The README's CPU wheel (a file on disk on the CI machine). The local version is named so that pip
# fails instead of taking the CUDA build of 2.13.0 from PyPI where that wheel is missing.
CPU_TORCH = "torch==2.13.0+cpu"
# What pip prints when it cannot reach the index (on its retries, then on a failed download).
NETWORK_ERRORS = ("NewConnectionError", "ConnectTimeoutError", "ReadTimeoutError", "ProxyError",
                  "Failed to establish a new connection", "Temporary failure in name resolution",
                  "Network is unreachable", "Max retries exceeded")
PIP_TIMEOUT_S = 600
PIP_RETRIES = 2  # per URL; pip's 5, with back-off, make an offline run wait two minutes to skip


def project_dependencies() -> list[Requirement]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [Requirement(line) for line in pyproject["project"]["dependencies"]]


def lower_bound(requirement: Requirement) -> Version:
    """The lowest version the specifier admits: its `>=`, `~=` or `==` version."""
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "~=", "==")]
    if not bounds:
        raise ValueError(f"{requirement} has no lower bound")
    lowest = max(bounds)
    if not requirement.specifier.contains(lowest, prereleases=True):
        raise ValueError(f"{requirement}: its lower bound {lowest} is itself excluded")
    return lowest


def lowest_pins() -> dict[str, Version]:
    """name -> lower bound, for every direct dependency but torch (which is the README's CPU wheel)."""
    return {r.name: lower_bound(r) for r in project_dependencies()
            if r.name != "torch" and (r.marker is None or r.marker.evaluate())}


def venv_env() -> dict[str, str]:
    """The environment for the venv's processes: nothing of the test interpreter's paths leaks in."""
    drop = {"PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"}
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONUNBUFFERED": "1"}


def pip_install(python: Path, *args: str) -> None:
    """`pip install ARGS` in the venv (pip's cache allowed); skip when the index is unreachable."""
    done = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
                           "--retries", str(PIP_RETRIES), *args],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT_S, cwd=REPO, env=venv_env(),
                          check=False)
    if done.returncode == 0:
        return
    output = done.stdout + done.stderr
    network = next((line for line in output.splitlines() if any(e in line for e in NETWORK_ERRORS)), None)
    if network is not None:  # part of the index was out of reach: a version not found there proves nothing
        pytest.skip(f"the package index is unreachable: ...{network.strip()[-160:]}")
    errors = "\n".join(line for line in output.splitlines() if not line.startswith("WARNING: "))
    pytest.fail(f"pip install {' '.join(args)} failed ({done.returncode}):\n{errors[-6000:]}")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`pip wheel . --no-deps`: the package as pip installs it from a source tree or an index."""
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
                    "-w", str(out), str(REPO)], check=True, timeout=PIP_TIMEOUT_S, capture_output=True)
    [built] = out.glob("moe_serve-*.whl")
    return built


@pytest.fixture(scope="module")
def lowest_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv: the CPU torch first, as the README installs it, then the wheel at the lower bounds."""
    root = tmp_path_factory.mktemp("lowest")
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    pip_install(python, CPU_TORCH)
    constraints = root / "lowest.txt"
    pins = [f"{name}=={version}" for name, version in lowest_pins().items()]
    constraints.write_text("\n".join([CPU_TORCH, *pins]) + "\n")
    pip_install(python, "-c", str(constraints), str(wheel))
    return python


@pytest.fixture(scope="module")
def lowest_server(lowest_python: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A bare `moe-serve` from the venv, in a folder that is not the repository: it can only serve
    what the wheel installed. The port comes from the environment, so the command stays bare."""
    port = free_port()
    where = tmp_path_factory.mktemp("elsewhere")
    log_path = where / f"server-{port}.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen([str(lowest_python.parent / "moe-serve")], cwd=where, stdout=log,
                                   stderr=subprocess.STDOUT, env={**venv_env(), "MOE_ARG_PORT": str(port)})
    server = RunningServer(f"http://127.0.0.1:{port}", process, log_path, "default", where)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.stop()


def test_the_wheel_is_one_package_holding_the_default_model_and_the_presets(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    packages = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert packages == {"moe_serve"}
    default = REPO / "moe_serve" / "models" / "default"
    assert {f"moe_serve/models/default/{f.name}" for f in default.iterdir() if f.is_file()} <= set(names)
    assert {f"moe_serve/configs/{p.name}" for p in (REPO / "moe_serve" / "configs").glob("*.yaml")} <= set(names)


def test_every_dependency_has_a_lower_bound() -> None:
    assert {r.name for r in project_dependencies()} - {"torch"} == set(lowest_pins())


def test_the_venv_holds_the_lower_bounds_and_the_cpu_torch(lowest_python: Path) -> None:
    probe = ("import importlib.metadata as m, json, sys, torch; names = json.loads(sys.argv[1]); "
             "print(json.dumps({'versions': {n: m.version(n) for n in names}, 'cuda': torch.version.cuda, "
             "'nvidia': [d.metadata['Name'] for d in m.distributions() if d.metadata['Name'].startswith('nvidia')]}))")
    pins = lowest_pins()
    done = subprocess.run([str(lowest_python), "-c", probe, json.dumps(list(pins))], capture_output=True, text=True,
                          check=True, timeout=120, env=venv_env())
    found = json.loads(done.stdout)
    assert {n: Version(v) for n, v in found["versions"].items()} == pins
    assert found["cuda"] is None and found["nvidia"] == []


def chat_body(server: RunningServer, **fields) -> dict:
    return {"model": server.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, **fields}


def test_chat_and_stream_at_the_lower_bounds(lowest_server: RunningServer) -> None:
    plain = lowest_server.post(CHAT, json=chat_body(lowest_server))
    assert plain.status_code == 200, plain.text
    body = plain.json()
    assert body["object"] == "chat.completion" and body["model"] == lowest_server.model
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] >= 1

    streamed = lowest_server.post(CHAT, json=chat_body(lowest_server, stream=True))
    assert streamed.status_code == 200 and streamed.headers["content-type"].startswith("text/event-stream")
    *chunks, done = sse_events(streamed.text)
    assert done == "[DONE]"
    parsed = [json.loads(c) for c in chunks]
    assert all(p["object"] == "chat.completion.chunk" for p in parsed)
    assert parsed[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    text = "".join(p["choices"][0]["delta"].get("content") or "" for p in parsed)
    assert text == choice["message"]["content"]  # greedy: the stream says what the plain answer said
    assert lowest_server.metric("moe_generation_tokens_total") >= body["usage"]["completion_tokens"]
    assert "Traceback" not in lowest_server.log()
