"""docker-compose.yml: the three services, their ports, and mounts that exist and fit together."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())


def mounts(service: str) -> dict[str, Path]:
    """container path -> host path, for the bind mounts of a service."""
    out = {}
    for volume in COMPOSE["services"][service].get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = REPO / source
    return out


def test_services_and_ports() -> None:
    services = COMPOSE["services"]
    assert set(services) == {"server", "prometheus", "grafana"}
    assert "8000:8000" in services["server"]["ports"]
    assert "9090:9090" in services["prometheus"]["ports"]
    assert "3000:3000" in services["grafana"]["ports"]
    assert services["server"]["build"] == "." and (REPO / "Dockerfile").exists()


def test_server_command_points_at_a_real_preset() -> None:
    command = COMPOSE["services"]["server"]["command"]
    preset = command[command.index("--config") + 1]
    default = preset.replace("${MOE_PRESET:-", "").replace("}", "")
    assert (REPO / default.replace("/app/", "")).exists()


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
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True, check=False).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def test_docker_compose_config_validates() -> None:
    command = _compose_command()
    if command is None:
        pytest.skip("neither `docker compose` nor `docker-compose` is installed here")
    done = subprocess.run([*command, "-f", str(REPO / "docker-compose.yml"), "config", "--quiet"],
                          capture_output=True, text=True, cwd=REPO, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
