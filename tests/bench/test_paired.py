"""bench/paired.py: its statistics, its arm syntax, and a CPU run in which every arm emits the
plain-greedy tokens for every prompt."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import paired, suite
from bench.rows import seeded_prompts
from moe_serve.engine.config import EngineConfig


def test_sign_test_matches_the_binomial_tails() -> None:
    assert paired.sign_test(5, 5) == pytest.approx(2 / 32)
    assert paired.sign_test(0, 5) == pytest.approx(2 / 32)
    assert paired.sign_test(3, 6) == 1.0
    assert paired.sign_test(0, 0) == 1.0


def test_compare_reports_the_median_ratio_and_calls_only_clear_wins() -> None:
    baseline = [2.0] * 12
    clear = paired.compare(baseline, [1.0] * 11 + [2.5])  # 11 of 12 pairs twice as fast
    assert clear["speedup_median"] == 2.0 and clear["faster_pairs"] == 11 and clear["pairs"] == 12
    assert clear["speedup_ci95"][0] > 1 and paired.verdict(clear) == "faster"
    mixed = paired.compare(baseline, [1.0, 4.0] * 6)
    assert paired.verdict(mixed) == "tie"
    few = paired.compare([2.0] * 4, [1.0] * 4)  # every pair faster, but 4 pairs cannot reach p < 0.05
    assert few["sign_test_p"] == pytest.approx(0.125) and paired.verdict(few) == "tie"
    assert paired.verdict(paired.compare([1.0] * 12, [2.0] * 12)) == "slower"


def test_an_arm_is_a_suite_row_with_overrides() -> None:
    base = EngineConfig(model="m", gpu_expert_budget="50%")
    arm = paired.parse_arm("SP-MoE@spec_cutoff=2,cache_policy=lru", base)
    assert (arm.config.spec, arm.config.spec_cutoff, arm.config.cache_policy) == ("draft", 2, "lru")
    assert arm.config.gpu_expert_budget == "50%"
    assert paired.parse_arm("plain SD", base).config.spec_cutoff == 0
    adaptive = paired.parse_arm("plain SD@spec_adaptive_tokens=true,spec_cutoff=none", base).config
    assert adaptive.spec_adaptive_tokens is True and adaptive.spec_cutoff is None
    with pytest.raises(SystemExit, match="exactly one"):
        paired.parse_arm("+", base)  # many rows contain '+'
    with pytest.raises(SystemExit, match="no field"):
        paired.parse_arm("LRU@no_such_field=1", base)


def test_a_cpu_run_pairs_every_prompt_and_every_arm_emits_the_same_tokens(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # the held-out corpus is built by the training script, not shipped: random prompts will do here
    monkeypatch.setattr(suite, "heldout_prompts", lambda target, count, length: seeded_prompts(8192, count, length))
    paired.main(["--device", "cpu", "--smoke", "--prompts", "2", "--tokens", "6", "--rounds", "1",
                 "--warmup-tokens", "3", "--arm", "plain SD", "--arm", "SP-MoE@spec_cutoff=2", "--arm", "LRU",
                 "--work-dir", str(tmp_path / "models"), "--out", str(tmp_path / "out")])
    result = json.loads((tmp_path / "out" / "paired.json").read_text())
    assert [(p["round"], p["prompt"]) for p in result["pairs"]] == [(0, 0), (0, 1)]
    assert all(p["same_tokens"] for p in result["pairs"]) and result["ratios"]["all_pairs_same_tokens"]
    assert [r["extra"]["prompts_timed"] for r in result["rows"]] == [2, 2, 2]
    assert set(result["comparisons"]) == {"SP-MoE@spec_cutoff=2", "ours offloaded, on-demand LRU"}
    table = (tmp_path / "out" / "paired.md").read_text()
    assert "SP-MoE@spec_cutoff=2 vs + external draft, no prefetch (plain SD): " in table
