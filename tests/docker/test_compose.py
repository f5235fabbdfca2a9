"""docker-compose.yml: the three services, their ports, the server's command, healthcheck and GPU,
and mounts that exist and fit together. `docker compose config` validates the file where the
compose plugin is installed; everything else reads the YAML, so it runs without Docker."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from moe_serve.server.cli import preset_names
from tests.docker.conftest import REPO, instructions

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVER = COMPOSE["services"]["server"]


def mounts(service: str) -> dict[str, Path]:
    """container path -> host path, for the bind mounts of a service."""
    out = {}
    for volume in COMPOSE["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = REPO / source
    return out


def _default(value: str) -> str:
    """A compose value with every ${VAR:-default} replaced by its default."""
    while "${" in value:
        start = value.index("${")
        end = value.index("}", start)
        value = value[:start] + value[start + 2:end].partition(":-")[2] + value[end + 1:]
    return value


def test_services_and_ports() -> None:
    services = COMPOSE["services"]
    assert set(services) == {"server", "prometheus", "grafana"}
    [exposed] = instructions("EXPOSE")
    assert f"{exposed}:{exposed}" in SERVER["ports"]
    assert "9090:9090" in services["prometheus"]["ports"]
    assert "3000:3000" in services["grafana"]["ports"]
    assert SERVER["build"] == "." and (REPO / "Dockerfile").exists()


def test_the_server_runs_the_image_entrypoint_on_a_real_preset_and_the_mounted_models() -> None:
    assert "entrypoint" not in SERVER  # the Dockerfile's: moe-serve on 0.0.0.0 and the exposed port
    assert json.loads(instructions("ENTRYPOINT")[0])[0] == "moe-serve"
    command = [_default(word) for word in SERVER["command"]]
    preset = command[command.index("--config") + 1]
    assert preset in preset_names()  # a preset shipped in the package, found by name
    model = Path(command[command.index("--model") + 1])
    [host_models] = [REPO / v.split(":")[0] for v in map(_default, SERVER["volumes"])
                     if v.split(":")[1] == str(model.parent)]
    assert (host_models / model.name / "config.json").is_file(), "the default model is not where compose mounts it"


def test_the_server_keeps_the_image_healthcheck() -> None:
    """The Dockerfile's HEALTHCHECK (tests/docker/test_dockerfile.py checks its route) applies unless
    compose replaces or disables it."""
    assert instructions("HEALTHCHECK")
    assert "healthcheck" not in SERVER, "compose overrides the image's healthcheck: test that one instead"


def test_the_server_reserves_one_nvidia_gpu() -> None:
    """One engine process drives one GPU; without the reservation the container sees none."""
    [device] = SERVER["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and device["count"] == 1 and device["capabilities"] == ["gpu"]


def test_prometheus_scrapes_the_server() -> None:
    [config] = mounts("prometheus").values()
    assert config.is_file()
    scrape = yaml.safe_load(config.read_text())["scrape_configs"][0]
    assert scrape["metrics_path"] == "/metrics"
    assert scrape["static_configs"][0]["targets"] == ["server:8000"]


def test_grafana_provisioning_is_mounted_and_consistent() -> None:
    grafana = mounts("grafana")
    provisioning, dashboards = grafana["/etc/grafana/provisioning"], grafana["/var/lib/grafana/dashboards"]
    [datasource] = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert datasource["url"] == "http://prometheus:9090"
    [provider] = yaml.safe_load((provisioning / "dashboards" / "moe-serve.yml").read_text())["providers"]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards"
    dashboard = json.loads((dashboards / "moe-serve.json").read_text())
    uids = {t["datasource"]["uid"] for p in dashboard["panels"] for t in p["targets"]}
    assert uids == {datasource["uid"]}


def _compose_command() -> list[str] | None:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True,
                                                 check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_validates() -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("no compose implementation here (`docker compose` plugin or docker-compose): "
                    "the YAML checks above still ran")
    done = subprocess.run([*command, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
