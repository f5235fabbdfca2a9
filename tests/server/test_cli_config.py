"""moe-serve flags and --config YAML: flags override the file, unknown keys fail, the key stays secret."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine.cli import engine_config_from_args
from server.cli import parse_args, server_settings_from_args


def write(tmp_path: Path, data: dict) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOE_API_KEY", raising=False)
    args = parse_args([])
    settings = server_settings_from_args(args)
    assert (settings.host, settings.port, settings.api_key) == ("127.0.0.1", 8000, None)
    assert Path(args.model).parts[-2:] == ("models", "default") and Path(args.model).is_absolute()
    assert settings.served_model_name == "default"


def test_flags_override_the_file(tmp_path: Path) -> None:
    config = write(tmp_path, {"gpu-expert-budget": "25%", "cache-policy": "lfu", "spec": "self", "port": 9001,
                              "trust-remote-code": True, "metrics-require-key": False})
    args = parse_args(["--config", config, "--cache-policy", "mrs"])
    engine = engine_config_from_args(args)
    assert (engine.gpu_expert_budget, engine.cache_policy, engine.spec, engine.trust_remote_code) == \
        ("25%", "mrs", "self", True)
    assert server_settings_from_args(args).port == 9001 and not args.metrics_require_key


def test_yaml_on_off_reach_on_off_flags(tmp_path: Path) -> None:
    """YAML 1.1 turns a bare `off` into False; it must still mean --cuda-graphs off."""
    args = parse_args(["--config", write(tmp_path, {"cuda-graphs": False})])
    assert engine_config_from_args(args).cuda_graphs is False


@pytest.mark.parametrize("data", [{"gpu_budget": "1GiB"}, {"config": "other.yaml"}, {"cache-policy": "fifo"},
                                  {"port": "eighty"}, {"port": True}, {"trust-remote-code": "yes"},
                                  ["spec", "self"]])
def test_bad_files_are_errors(tmp_path: Path, data: object, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--config", write(tmp_path, data)])
    assert exit_info.value.code == 2
    assert "error" in capsys.readouterr().err


def test_api_key_from_env_and_never_described(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_API_KEY", "from-env")
    settings = server_settings_from_args(parse_args([]))
    assert settings.api_key == "from-env"
    assert "from-env" not in str(settings.describe())
    assert server_settings_from_args(parse_args(["--api-key", "flag"])).api_key == "flag"


def test_positive_limits(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--max-queue", "0"])
    assert "at least 1" in capsys.readouterr().err
