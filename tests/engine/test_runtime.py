"""The whole engine (loader + cached runner + decoder + core) against transformers' own generate.

Caching must never change the math: with a budget smaller than the experts, under every
eviction policy and with prefetch on and off, greedy tokens equal transformers' greedy tokens.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import pytest
import torch

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore, run_to_completion
from moe_serve.engine.messages import GenerateRequest, SamplingParams
from tests.tiny_checkpoints import MOE_FAMILIES, build_tiny_checkpoint, tiny_hf_model

PROMPT = (3, 17, 42, 5, 99, 7, 12, 64)
# On a GPU machine the same tests run the CUDA copy path (streams, events, pinned store) too.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("ckpt")
    return {family: str(build_tiny_checkpoint(family, root / family)) for family in MOE_FAMILIES}


@functools.cache
def hf_greedy(family: str) -> list[int]:
    model = tiny_hf_model(family)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def greedy(config: EngineConfig) -> tuple[list[int], dict]:
    core = EngineCore(config)
    try:
        done = run_to_completion(core, GenerateRequest("r", PROMPT, SamplingParams(max_tokens=NEW_TOKENS, temperature=0)))
        return done.token_ids, core.runtime.generation_stats(ttft_seconds=done.ttft_seconds, tpot_seconds=done.tpot_seconds)
    finally:
        core.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", MOE_FAMILIES)
@pytest.mark.parametrize("policy,prefetch", [("lru", "none"), ("lfu", "next-layer"), ("mrs", "none"), ("mrs", "next-layer"),
                                             ("next-use", "none")])
def test_offloaded_greedy_equals_transformers(checkpoints, device, family, policy, prefetch):
    config = EngineConfig(model=checkpoints[family], device=device, dtype="float32", gpu_expert_budget="40%",
                          cache_policy=policy, prefetch=prefetch)
    tokens, stats = greedy(config)
    assert tokens == hf_greedy(family)
    assert stats["expert_misses"] > 0, "the budget must force misses for this test to mean anything"
    assert stats["expert_hits"] + stats["expert_misses"] > 0
    assert stats["pcie_bytes"] > 0


@pytest.mark.parametrize("device", DEVICES)
def test_cpu_experts_auto_equals_transformers_and_is_counted(checkpoints, device):
    config = EngineConfig(model=checkpoints["olmoe"], device=device, dtype="float32", gpu_expert_budget="40%",
                          cpu_experts="auto")
    core = EngineCore(config)
    try:
        done = run_to_completion(core, GenerateRequest("r", PROMPT, SamplingParams(max_tokens=NEW_TOKENS, temperature=0)))
        stats = core.runtime.generation_stats(ttft_seconds=None, tpot_seconds=None)
        assert done.token_ids == hf_greedy("olmoe")
        assert stats["cpu_expert_computations"] == core.metrics_snapshot().cpu_expert_computations
        assert core.runtime.describe()["cpu_experts"] == "auto"
    finally:
        core.close()


def test_seeded_sampling_is_reproducible_and_seed_dependent(checkpoints):
    config = EngineConfig(model=checkpoints["olmoe"], gpu_expert_budget="50%")
    core = EngineCore(config)
    try:
        def sample(seed: int) -> list[int]:
            params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
            return run_to_completion(core, GenerateRequest(f"s{seed}", PROMPT, params)).token_ids

        first, again, other = sample(1), sample(1), sample(2)
    finally:
        core.close()
    assert first == again
    assert first != other


def test_stop_token_and_length_finish(checkpoints):
    expected = hf_greedy("mixtral")
    stop = expected[5]
    core = EngineCore(EngineConfig(model=checkpoints["mixtral"]))
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, stop_token_ids=(stop,))
        stopped = run_to_completion(core, GenerateRequest("a", PROMPT, params))
        capped = run_to_completion(core, GenerateRequest("b", PROMPT, SamplingParams(max_tokens=3, temperature=0)))
    finally:
        core.close()
    assert stopped.token_ids == expected[: expected.index(stop) + 1]
    assert stopped.finish_reason == "stop"
    assert capped.token_ids == expected[:3] and capped.finish_reason == "length"


def test_abort_frees_the_running_sequence(checkpoints):
    core = EngineCore(EngineConfig(model=checkpoints["qwen3_moe"]))
    try:
        core.add_request(GenerateRequest("x", PROMPT, SamplingParams(max_tokens=50, temperature=0)))
        core.step()
        final = core.abort_request("x")
        assert final is not None and final.finish_reason == "abort"
        assert not core.has_unfinished()
        assert core.metrics_snapshot().num_running == 0
    finally:
        core.close()


def test_moe_generate_json(checkpoints):
    out = subprocess.run(
        [sys.executable, "-m", "moe_serve.engine.cli", "--model", checkpoints["qwen2_moe"], "--prompt-ids",
         ",".join(map(str, PROMPT)), "--max-tokens", "6", "--gpu-expert-budget", "50%", "--json"],
        capture_output=True, text=True, check=True,
    )
    result = json.loads(out.stdout)
    assert result["token_ids"] == hf_greedy("qwen2_moe")[:6]
    for key in ("expert_hits", "expert_misses", "hit_rate", "pcie_bytes", "pcie_wait_seconds", "cpu_expert_computations",
                "tpot_seconds", "ttft_seconds"):
        assert key in result["stats"]
    assert "text" not in result  # the tiny checkpoint has no tokenizer


@pytest.mark.parametrize("spec", ["self", "draft"])
def test_speculative_runtime_equals_plain_greedy(checkpoints, tmp_path, spec):
    draft = None
    if spec == "draft":
        draft = str(build_tiny_checkpoint("qwen3", tmp_path / "draft"))
    config = EngineConfig(model=checkpoints["qwen3_moe"], gpu_expert_budget="40%", spec=spec, draft=draft,
                          spec_tokens=3)
    tokens, stats = greedy(config)
    assert tokens == hf_greedy("qwen3_moe")
    assert stats["verify_steps"] > 0
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert stats["draft_seconds"] > 0 and stats["verify_seconds"] > 0


def test_record_routing_writes_one_line_per_position_and_layer(checkpoints, tmp_path):
    trace = tmp_path / "routing.jsonl"
    config = EngineConfig(model=checkpoints["mixtral"], gpu_expert_budget="50%", record_routing=str(trace))
    tokens, _ = greedy(config)
    lines = [json.loads(line) for line in trace.read_text().splitlines()]
    num_moe_layers = 3  # the tiny Mixtral: 3 layers, every one MoE
    # every fed position (prompt + all generated tokens but the last) was routed in every layer
    assert len(lines) == (len(PROMPT) + len(tokens) - 1) * num_moe_layers
    assert {(line["pos"], line["layer"]) for line in lines} == {
        (p, layer) for p in range(len(PROMPT) + len(tokens) - 1) for layer in range(num_moe_layers)}
    assert all(len(line["experts"]) == 2 for line in lines)
