"""Every preset in moe_serve/configs/ parses as moe-serve flags (unknown keys would be an error)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from moe_serve.engine.cli import engine_config_from_args
from moe_serve.engine.config import parse_budget
from moe_serve.server.cli import build_parser, parse_args

CONFIGS = Path(__file__).resolve().parents[2] / "moe_serve" / "configs"
PRESETS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "prometheus.yml")
EXPECTED = {"mixtral-8x7b-24gb.yaml", "qwen3-30b-a3b-16gb.yaml", "qwen1.5-moe-a2.7b-16gb.yaml", "olmoe-1b-7b-8gb.yaml"}


def test_the_four_presets_exist() -> None:
    assert {p.name for p in PRESETS} >= EXPECTED


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_uses_real_flags_and_parses(preset: Path) -> None:
    data = yaml.safe_load(preset.read_text())
    flags = {opt[2:] for action in build_parser()._actions for opt in action.option_strings}
    assert set(data) <= flags
    assert {"gpu-expert-budget", "cache-policy", "spec"} <= set(data)
    args = parse_args(["--config", str(preset)])
    engine = engine_config_from_args(args)
    assert engine.gpu_expert_budget == str(data["gpu-expert-budget"])
    assert parse_budget(engine.gpu_expert_budget) > 1  # an absolute size, not a fraction
    assert (engine.cache_policy, engine.spec) == (data["cache-policy"], data["spec"])
    assert "revisit" in preset.read_text()  # first guesses, to be replaced by measured values
