"""moe-serve flags from the command line, a --config YAML and MOE_ARG_* variables (in that precedence);
help, version, sampling defaults, chat template, threads; the API key stays secret."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from moe_serve.engine.cli import engine_config_from_args
from moe_serve.engine.cli_flags import env_name
from moe_serve.engine.config import ConfigError
from moe_serve.server.cli import build_parser, parse_args, server_settings_from_args, set_engine_threads, usable_cores
from moe_serve.server.settings import SamplingDefaults, read_chat_template


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


def test_tokenizer_folder_reaches_the_engine(tmp_path: Path) -> None:
    """The engine compiles structured outputs' grammars with it, so it is the engine's setting."""
    assert engine_config_from_args(parse_args([])).tokenizer_path == parse_args([]).model
    args = parse_args(["--config", write(tmp_path, {"tokenizer": "/tokenizer"})])
    assert engine_config_from_args(args).tokenizer_path == "/tokenizer"


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


def test_precedence_command_line_then_file_then_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_ARG_PORT", "7001")
    monkeypatch.setenv("MOE_ARG_CACHE_POLICY", "lfu")
    monkeypatch.setenv("MOE_ARG_MAX_QUEUE", "5")
    config = write(tmp_path, {"port": 7002, "cache-policy": "mrs"})
    args = parse_args(["--config", config, "--port", "7003"])
    assert (args.port, args.cache_policy, args.max_queue) == (7003, "mrs", 5)
    assert parse_args([]).port == 7001


@pytest.mark.parametrize(("value", "expected"), [("1", True), ("true", True), ("0", False), ("off", False)])
def test_environment_switches(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("MOE_ARG_TRUST_REMOTE_CODE", value)
    assert parse_args([]).trust_remote_code is expected


def test_bad_environment_values_are_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setenv("MOE_ARG_TRUST_REMOTE_CODE", "maybe")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "MOE_ARG_TRUST_REMOTE_CODE" in capsys.readouterr().err


def test_every_flag_has_an_environment_variable() -> None:
    names = {env_name(action) for action in build_parser()._actions} - {None}
    assert {"MOE_ARG_MODEL", "MOE_ARG_GPU_MEMORY_UTILIZATION", "MOE_ARG_LOG_LEVEL", "MOE_ARG_API_KEY"} <= names
    assert len(names) == len([a for a in build_parser()._actions if a.option_strings]) - 2  # --help, --version


def test_positional_model_is_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    assert parse_args(["/models/x"]).model == "/models/x"
    monkeypatch.setenv("MOE_ARG_MODEL", "/models/env")
    assert parse_args(["/models/x", "--config", write(tmp_path, {"model": "/models/file"})]).model == "/models/x"
    assert parse_args(["/models/x", "--model", "/models/x"]).model == "/models/x"
    with pytest.raises(SystemExit):
        parse_args(["/models/x", "--model", "/models/y"])
    assert "two models" in capsys.readouterr().err


def test_every_flag_has_help_and_shows_its_default() -> None:
    parser = build_parser()
    formatter = parser.formatter_class(parser.prog)
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        text = formatter._get_help_string(action)
        assert action.help, action.option_strings
        assert "default" in text or action.nargs == 0, (action.option_strings, text)


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("moe-serve ")


def test_sampling_defaults_come_from_generation_config(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    assert SamplingDefaults.read("auto", str(tmp_path)) == SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20)
    assert SamplingDefaults.read("vllm", str(tmp_path)) == SamplingDefaults()
    assert SamplingDefaults.read("auto", str(tmp_path / "elsewhere")) == SamplingDefaults()
    with pytest.raises(ConfigError):
        SamplingDefaults.read(str(tmp_path / "elsewhere"), str(tmp_path))
    # the default model's generation_config.json says do_sample: false, which is greedy
    settings = server_settings_from_args(parse_args([]))
    assert settings.sampling_defaults.temperature == 0.0


def test_chat_template_from_file_or_inline(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert read_chat_template(str(tmp_path / "t.jinja")) == template
    assert read_chat_template(template) == template
    with pytest.raises(ConfigError, match="no such file"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ConfigError, match="line 1"):
        read_chat_template("{% for m in messages %}")


def test_engine_threads_are_set_when_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # records the variable's value before, for the undo
    monkeypatch.delenv("OMP_NUM_THREADS")
    set_engine_threads(api_servers=1)
    assert int(os.environ["OMP_NUM_THREADS"]) == max(1, usable_cores() - 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    set_engine_threads(api_servers=4)  # a core left to each API server process
    assert int(os.environ["OMP_NUM_THREADS"]) == max(1, usable_cores() - 4)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    set_engine_threads(api_servers=1)
    assert os.environ["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize(("cpu_max", "cap"), [("max 100000", None), ("150000 100000", 2), ("50000 100000", 1)])
def test_usable_cores_honour_a_container_quota(tmp_path: Path, cpu_max: str, cap: int | None) -> None:
    (tmp_path / "cpu.max").write_text(cpu_max + "\n")
    cores = len(os.sched_getaffinity(0))
    assert usable_cores(tmp_path / "cpu.max") == (cores if cap is None else min(cores, cap))
    assert usable_cores(tmp_path / "absent") == cores
