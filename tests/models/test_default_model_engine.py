"""Our engine runs the shipped default model exactly as transformers does."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore, run_to_completion
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.messages import GenerateRequest, SamplingParams
from moe_serve.engine.runtime import build_runtime

MODELS = Path(__file__).resolve().parents[2] / "moe_serve" / "models"
TARGET, DRAFT = MODELS / "default", MODELS / "default-draft"
PROMPT = "import os\n\ndef list_python_files(root):\n"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TARGET)


@pytest.mark.parametrize("path", [TARGET, DRAFT], ids=["target", "draft"])
def test_logits_equal_transformers(path, tokenizer):
    from transformers import AutoModelForCausalLM

    ids = tokenizer.encode(PROMPT)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]  # [T, V]
    runtime = build_runtime(EngineConfig(model=str(path), gpu_expert_budget="50%" if path == TARGET else None))
    try:
        kv = KVCache.for_model(runtime.model_config, 256, device="cpu", dtype=torch.float32)
        got = runtime.target.model(torch.tensor(ids), 0, kv)
    finally:
        runtime.close()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


def test_speculative_greedy_on_the_default_pair_equals_plain(tokenizer):
    ids = tuple(tokenizer.encode(PROMPT))
    params = SamplingParams(max_tokens=24, temperature=0)
    outputs = {}
    for spec in ("off", "self", "draft"):
        core = EngineCore(EngineConfig(model=str(TARGET), gpu_expert_budget="40%", spec=spec,
                                       draft=str(DRAFT) if spec == "draft" else None))
        try:
            outputs[spec] = run_to_completion(core, GenerateRequest(spec, ids, params)).token_ids
            stats = core.runtime.generation_stats(ttft_seconds=None, tpot_seconds=None)
        finally:
            core.close()
        if spec != "off":
            assert stats["verify_steps"] > 0
    assert outputs["self"] == outputs["off"] == outputs["draft"]
