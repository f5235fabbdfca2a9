"""The Dockerfile's Python layer agrees with the project: the base image's torch is one pyproject
allows, pip installs the project the way the README says, every copied path exists and reaches
the build context, the entrypoint is moe-serve and the healthcheck asks a route that answers.
Docker cannot build the image on the CI machine (README, Docker), so these read the files."""
from __future__ import annotations

import json
import re
import shlex
from urllib.parse import urlparse

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from tests.docker.conftest import REPO, arg_default, copy_sources, ignored, instructions
from tests.server.conftest import RunningServer

tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11's tomllib")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
README = (REPO / "README.md").read_text()


def _torch_requirement() -> Requirement:
    [torch] = [r for r in map(Requirement, PYPROJECT["project"]["dependencies"]) if r.name == "torch"]
    return torch


def test_the_base_image_torch_is_one_pyproject_keeps() -> None:
    """pytorch/pytorch:<torch>-cuda<X>-cudnn<Y>-runtime: pip must keep that torch, not fetch another."""
    image, _, tag = arg_default("BASE").partition(":")
    assert image == "pytorch/pytorch" and tag.endswith("-runtime"), tag
    assert Version(tag.split("-")[0]) in _torch_requirement().specifier, tag
    assert instructions("FROM") == ["${BASE}"]


def test_the_cpu_build_pins_the_readme_torch() -> None:
    [readme_pin] = set(re.findall(r"pip install (torch==[\w.+]+)", README))
    [run] = [r for r in instructions("RUN") if "TORCH_CPU" in r]
    assert f'"{readme_pin}"' in run or f" {readme_pin} " in run, (readme_pin, run)


def _project_install() -> list[str]:
    """The `pip install` words of the RUN that installs the project itself (from /app)."""
    for run in instructions("RUN"):
        for command in re.split(r"&&|;", run):
            words = shlex.split(command)
            if words[:2] == ["pip", "install"] and any(w == "." or w.startswith(".[") for w in words):
                return words
    raise AssertionError("no RUN installs the project")


def test_pip_installs_the_project_as_the_readme_says() -> None:
    words = _project_install()
    assert f"`{' '.join(words)}`" in README, f"README does not give `{' '.join(words)}` for CUDA machines"
    [target] = [w for w in words if w == "." or w.startswith(".[")]
    extras = set(re.findall(r"[\w-]+", target.removeprefix(".")))
    assert extras <= set(PYPROJECT["project"].get("optional-dependencies", {})), extras


def test_every_copied_path_exists_and_reaches_the_build_context() -> None:
    sources = copy_sources()
    for source in sources:
        assert (REPO / source).exists(), source
        assert not ignored(source), f".dockerignore leaves out {source}, which the Dockerfile copies"
    # everything pip needs to install the package: its metadata, readme and the packages it finds
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert {"pyproject.toml", PYPROJECT["project"]["readme"], *packages} <= set(sources)
    # and every file of the copied folders (the default model and the presets among them)
    for folder in (REPO / s for s in sources if (REPO / s).is_dir()):
        kept = [f for f in folder.rglob("*") if f.is_file() and "__pycache__" not in f.parts]
        assert kept, folder
        left_out = [str(f.relative_to(REPO)) for f in kept if ignored(str(f.relative_to(REPO)))]
        assert not left_out, left_out
    assert (REPO / "moe_serve" / "models" / "default" / "config.json").is_file() and "moe_serve" in sources


def test_the_build_context_leaves_out_what_the_image_does_not_need() -> None:
    for path in (".git", ".out", ".whl", ".hypothesis", "tests", "bench/results", "loadtest",
                 "moe_serve.egg-info", "moe_serve/server/__pycache__/app.cpython-311.pyc"):
        assert ignored(path), path


def _entrypoint() -> list[str]:
    [entrypoint] = instructions("ENTRYPOINT")
    return json.loads(entrypoint)  # the exec form: no shell between Docker's signals and the server


def _exposed_port() -> int:
    [port] = instructions("EXPOSE")
    return int(port)


def test_the_entrypoint_is_moe_serve_listening_on_the_exposed_port() -> None:
    words = _entrypoint()
    assert words[0] == "moe-serve" and "moe-serve" in PYPROJECT["project"]["scripts"]
    assert words[words.index("--host") + 1] == "0.0.0.0"  # reachable through the published port
    assert int(words[words.index("--port") + 1]) == _exposed_port()


def test_the_healthcheck_asks_a_route_that_answers(server: RunningServer) -> None:
    [healthcheck] = instructions("HEALTHCHECK")
    [url] = re.findall(r"https?://[^'\"\s)]+", healthcheck)
    parsed = urlparse(url)
    assert parsed.port == _exposed_port() and parsed.hostname in ("127.0.0.1", "localhost")
    assert server.get(parsed.path).status_code == 200  # the engine is loaded: healthy
