"""The presets in moe_serve/configs/: each parses through moe-serve's own parser, fits the card it names by
the engine's own memory plan (model shapes written here from each checkpoint's config.json: nothing is
downloaded), says in its comments the numbers that plan gives, speculates consistently, and cites
benchmark files that exist."""
from __future__ import annotations

import re
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from moe_serve.engine.cli import engine_config_from_args, model_given
from moe_serve.engine.config import EngineConfig, parse_budget, parse_bytes
from moe_serve.engine.kv.paged_cache import kv_bytes_per_token
from moe_serve.engine.memory_plan import MemoryPlan, non_expert_bytes, plan_memory
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.runtime import KV_BLOCK_SIZE
from moe_serve.server.cli import build_parser, parse_args

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "moe_serve" / "configs"
RESULTS = REPO / "bench" / "results"
PRESETS = sorted(CONFIGS.glob("*.yaml"))
GIB = 2**30
BF16 = torch.bfloat16

# config.json fields the engine reads, as each checkpoint publishes them
MIXTRAL_8X7B = {"architectures": ["MixtralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
                "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
                "max_position_embeddings": 32768, "rope_theta": 1e6, "sliding_window": None,
                "tie_word_embeddings": False}
MISTRAL_7B = {"architectures": ["MistralForCausalLM"], "vocab_size": 32000, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 32768, "sliding_window": 4096,
              "tie_word_embeddings": False}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                 "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
                 "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                 "max_position_embeddings": 40960, "rope_theta": 1e6, "tie_word_embeddings": False}
QWEN3_0_6B = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
              "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1e6,
              "tie_word_embeddings": False}  # counted untied: the larger case
QWEN1_5_MOE_A2_7B = {"architectures": ["Qwen2MoeForCausalLM"], "vocab_size": 151936, "hidden_size": 2048,
                     "intermediate_size": 5632, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
                     "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 60,
                     "num_experts_per_tok": 4, "norm_topk_prob": False, "decoder_sparse_step": 1,
                     "max_position_embeddings": 8192, "rope_theta": 1e6, "tie_word_embeddings": False}
QWEN1_5_0_5B = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
                "intermediate_size": 2816, "num_hidden_layers": 24, "num_attention_heads": 16,
                "num_key_value_heads": 16, "max_position_embeddings": 32768, "rope_theta": 1e6,
                "tie_word_embeddings": True}
OLMOE_1B_7B = {"architectures": ["OlmoeForCausalLM"], "vocab_size": 50304, "hidden_size": 2048,
               "intermediate_size": 1024, "num_hidden_layers": 16, "num_attention_heads": 16,
               "num_key_value_heads": 16, "num_experts": 64, "num_experts_per_tok": 8,
               "max_position_embeddings": 4096, "clip_qkv": None, "tie_word_embeddings": False}

# preset -> (target, the draft it names or None, the card in decimal GB: cards that report a little less fit)
MACHINES: dict[str, tuple[dict[str, Any], dict[str, Any] | None, int]] = {
    "mixtral-8x7b-24gb": (MIXTRAL_8X7B, None, 24),
    "qwen3-30b-a3b-16gb": (QWEN3_30B_A3B, QWEN3_0_6B, 16),
    "qwen1.5-moe-a2.7b-16gb": (QWEN1_5_MOE_A2_7B, QWEN1_5_0_5B, 16),
    "olmoe-1b-7b-8gb": (OLMOE_1B_7B, None, 8),
}
CUDA_CONTEXT = GIB // 2  # in use when the engine plans: what the arithmetic assumes of the card
MEASURED_DRAFT_GAMMAS = (8, 12)  # the external draft's best lengths (README, Performance)


def _data(preset: Path) -> dict[str, Any]:
    return yaml.safe_load(preset.read_text())


def _engine(preset: Path) -> EngineConfig:
    return engine_config_from_args(parse_args(["/models/target", "--config", preset.stem]))


def _plan(preset: Path) -> MemoryPlan:
    target, draft, card_gb = MACHINES[preset.stem]
    engine = _engine(preset)
    draft_config = ModelConfig.from_hf(draft) if draft is not None and engine.spec == "draft" else None
    max_len = engine.max_model_len or target["max_position_embeddings"]  # unset: the model's own
    return plan_memory(engine, ModelConfig.from_hf(target), draft_config, BF16, max_len, KV_BLOCK_SIZE, card_gb * 10**9,
                       CUDA_CONTEXT)


def test_the_four_presets_and_only_they() -> None:
    assert {p.stem for p in PRESETS} == set(MACHINES)


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_preset_uses_real_flags_and_parses(preset: Path) -> None:
    data = _data(preset)
    flags = {opt[2:] for action in build_parser()._actions for opt in action.option_strings}
    assert set(data) <= flags
    assert {"gpu-expert-budget", "kv-cache-memory", "max-num-seqs", "cache-policy", "prefetch",
            "cpu-experts", "spec"} <= set(data)
    assert "model" not in data  # a preset needs its folder given: moe-serve DIR --config NAME
    args = parse_args(["--config", preset.stem])
    assert not model_given(args)
    engine = engine_config_from_args(parse_args(["/models/target", "--config", preset.stem]))
    assert engine.model == "/models/target"
    assert isinstance(parse_budget(engine.gpu_expert_budget), int)  # an absolute size, not a fraction
    assert (engine.cache_policy, engine.prefetch, engine.cpu_experts, engine.spec) == (
        data["cache-policy"], data["prefetch"], data["cpu-experts"], data["spec"])
    assert f"--config {preset.stem}" in preset.read_text()  # its usage line


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_budget_weights_and_kv_fit_the_card(preset: Path) -> None:
    plan = _plan(preset)  # raises ConfigError when the KV cache or the experts get nothing
    engine = _engine(preset)
    target = ModelConfig.from_hf(MACHINES[preset.stem][0])
    assert plan.total_bytes <= plan.usable_bytes
    assert plan.expert_bytes == parse_bytes(engine.gpu_expert_budget) < plan.all_expert_bytes
    assert plan.kv_bytes == parse_bytes(engine.kv_cache_memory)
    expert_slot_bytes = target.expert_layout(BF16).nbytes
    assert plan.expert_bytes // expert_slot_bytes >= target.num_experts  # at least a whole layer's experts
    # max-num-seqs: what the paged KV cache holds at 512 tokens each
    tokens = plan.kv_bytes // kv_bytes_per_token(target, BF16)
    assert engine.max_num_seqs * 512 <= tokens


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_comments_state_the_plans_numbers(preset: Path) -> None:
    plan, text = _plan(preset), preset.read_text()
    target, draft, _ = MACHINES[preset.stem]
    share = plan.expert_bytes / plan.all_expert_bytes
    assert f"{share:.1%} of {plan.all_expert_bytes / GIB:.1f} GiB" in text
    assert f"total         {plan.total_bytes / GIB:.2f} GiB of {plan.usable_bytes / GIB:.2f}" in text
    assert f"non-expert    {non_expert_bytes(ModelConfig.from_hf(target), BF16) / GIB:.2f} GiB" in text
    assert f"in use        {plan.in_use_bytes / GIB:.2f} GiB" in text
    assert f"activations   {plan.activation_bytes / GIB:.2f} GiB" in text
    assert f"= {plan.sequence_kv_bytes / GIB:.2f} GiB" in text  # the one-sequence KV line
    if draft is not None:
        assert f"draft         {non_expert_bytes(ModelConfig.from_hf(draft), BF16) / GIB:.2f} GiB" in text


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_speculation_is_consistent(preset: Path) -> None:
    data, engine = _data(preset), _engine(preset)
    target, draft, _ = MACHINES[preset.stem]
    if engine.spec == "draft":
        assert engine.draft and draft is not None
        assert Path(engine.draft).name in preset.read_text().splitlines()[0]  # the title names the draft
        draft_config, target_config = ModelConfig.from_hf(draft), ModelConfig.from_hf(target)
        assert not draft_config.is_moe and draft_config.vocab_size == target_config.vocab_size
        assert engine.spec_tokens in MEASURED_DRAFT_GAMMAS
        assert engine.spec_tokens + 1 <= 16  # the verify span replays a CUDA graph (engine/graphs.py MAX_TOKENS)
        assert "spec-top-r" not in data
    else:
        assert "draft" not in data and draft is None
    if engine.spec == "self":
        assert 1 <= engine.spec_top_r < ModelConfig.from_hf(target).top_k


def test_mistral_7b_leaves_mixtral_almost_no_expert_slots_on_24_gb() -> None:
    """Why the Mixtral preset self-drafts: its tokenizer's dense sibling is too big for the card."""
    mixtral, mistral = ModelConfig.from_hf(MIXTRAL_8X7B), ModelConfig.from_hf(MISTRAL_7B)
    # a draft model's paged KV shares the target's blocks: one sequence holds both
    one_sequence = (kv_bytes_per_token(mixtral, BF16) + kv_bytes_per_token(mistral, BF16)) * 4096
    engine = EngineConfig(model="x", spec="draft", draft="y", max_model_len=4096, max_num_seqs=32,
                          kv_cache_memory=str(one_sequence))
    plan = plan_memory(engine, mixtral, mistral, BF16, 4096, KV_BLOCK_SIZE, 24 * 10**9, CUDA_CONTEXT)
    expert_slots = plan.expert_bytes // mixtral.expert_layout(BF16).nbytes
    assert expert_slots == 0  # one sequence's KV of both models takes the rest of the card
    assert f"{(plan.usable_bytes - plan.total_bytes + plan.expert_bytes + plan.kv_bytes) / GIB:.1f} GiB left" in (
        CONFIGS / "mixtral-8x7b-24gb.yaml").read_text()


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.stem)
def test_cited_result_files_exist(preset: Path) -> None:
    cited = [name for name in re.findall(r"[\w./{},-]+\.(?:md|json)", preset.read_text()) if name != "config.json"]
    assert cited
    for name in cited:
        for path in _expand(name.removeprefix("bench/results/")):
            assert (RESULTS / path).is_file() or any(RESULTS.rglob(path)), f"{preset.name} cites {name}"


def _expand(name: str) -> list[str]:
    """default-mixtral-rest-{25,50}.md -> both names."""
    parts = re.split(r"\{([^}]*)\}", name)
    options = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(choice) for choice in product(*options)]
