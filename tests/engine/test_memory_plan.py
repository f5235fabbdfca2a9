"""The start-up split of GPU memory: weights, reserves, paged KV cache and expert cache add up within
--gpu-memory-utilization; fixed parts are kept; what cannot fit is a ConfigError naming the numbers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve.engine.config import ConfigError, EngineConfig
from moe_serve.engine.core import EngineCore
from moe_serve.engine.experts.runner import CachedExpertRunner
from moe_serve.engine.kv.paged_cache import kv_bytes_per_token
from moe_serve.engine.loader import load_model, read_config
from moe_serve.engine.memory_plan import GIB, KV_SHARE, activation_bytes, non_expert_bytes, plan_memory
from moe_serve.engine.messages import GenerateRequest, SamplingParams
from moe_serve.engine.models.config import ModelConfig

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "moe_serve" / "models" / "default"
MODEL = read_config(DEFAULT_MODEL)
DTYPE = torch.bfloat16
BLOCK = 16
ALL_EXPERTS = MODEL.num_moe_layers * MODEL.num_experts * MODEL.expert_layout(DTYPE).nbytes


def plan(device_bytes: int | None, max_len: int = 1024, **settings):
    return plan_memory(EngineConfig(model="m", **settings), MODEL, None, DTYPE, max_len, BLOCK, device_bytes)


def fixed_bytes(model: ModelConfig, max_len: int) -> int:
    return non_expert_bytes(model, DTYPE) + kv_bytes_per_token(model, DTYPE) * max_len + activation_bytes(
        EngineConfig(model="m"), model, DTYPE)


def test_non_expert_weights_are_counted_exactly() -> None:
    loaded = load_model(DEFAULT_MODEL, "cpu", DTYPE,
                        runner_factory=lambda store, config: CachedExpertRunner(store, None, top_k=config.top_k))
    model = loaded.model
    assert non_expert_bytes(MODEL, DTYPE) == sum(t.numel() * t.element_size()
                                                 for t in [*model.parameters(), *model.buffers()])


def test_everything_resident_when_it_fits() -> None:
    p = plan(80 * GIB)
    assert p.expert_budget is None and p.expert_bytes == ALL_EXPERTS
    assert p.kv_bytes == 64 * (1024 // BLOCK) * BLOCK * kv_bytes_per_token(MODEL, DTYPE)
    assert p.total_bytes <= p.usable_bytes == int(0.9 * 80 * GIB)


def test_experts_that_do_not_fit_leave_the_kv_cache_its_share() -> None:
    fixed = fixed_bytes(MODEL, 1024)
    device = int((fixed + ALL_EXPERTS // 2) / 0.9)  # room for about half the experts
    p = plan(device)
    left = p.usable_bytes - fixed
    assert p.expert_bytes == left - p.kv_bytes < ALL_EXPERTS
    assert p.kv_bytes >= min(int(KV_SHARE * left), 64 * 1024 * kv_bytes_per_token(MODEL, DTYPE))
    assert p.expert_budget == str(p.expert_bytes)


def test_a_fixed_expert_budget_gives_the_rest_to_the_kv_cache() -> None:
    fixed = fixed_bytes(MODEL, 1024)
    one_sequence = 1024 * kv_bytes_per_token(MODEL, DTYPE)
    p = plan(int((fixed + ALL_EXPERTS // 4 + 2 * one_sequence) / 0.9), gpu_expert_budget="25%")
    assert p.expert_bytes == ALL_EXPERTS // 4
    assert one_sequence <= p.kv_bytes <= p.usable_bytes - fixed - p.expert_bytes


def test_the_plan_says_how_many_expert_slots_fit() -> None:
    experts = MODEL.num_moe_layers * MODEL.num_experts
    p = plan(80 * GIB, gpu_expert_budget="25%")
    assert p.expert_slots == experts // 4 and p.one_expert_bytes * experts == ALL_EXPERTS
    assert f"({experts // 4} expert slots of " in p.describe()
    assert plan(80 * GIB).expert_slots == experts


def test_a_fixed_kv_cache_gives_the_rest_to_experts() -> None:
    p = plan(80 * GIB, kv_cache_memory="8MiB")
    assert p.kv_bytes == 8 * 2**20 and p.expert_bytes == ALL_EXPERTS


def test_too_little_memory_names_the_numbers() -> None:
    with pytest.raises(ConfigError, match="no GPU memory is left for experts: in use at start-up .* [+] weights .* MiB"):
        plan(fixed_bytes(MODEL, 1024) + 2**20, gpu_memory_utilization=1.0)
    with pytest.raises(ConfigError, match="less than one sequence of max_model_len 1024 needs"):
        plan(fixed_bytes(MODEL, 1024) + ALL_EXPERTS, gpu_memory_utilization=1.0, gpu_expert_budget="100%")


def test_on_the_cpu_utilization_does_not_apply() -> None:
    p = plan(None, max_len=512, gpu_memory_utilization=0.1)
    assert p.usable_bytes is None and p.expert_budget is None and p.activation_bytes == 0
    assert p.kv_bytes == 64 * 512 * kv_bytes_per_token(MODEL, DTYPE)
    assert "does not apply" in p.describe()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_a_full_batch_stays_within_the_utilization() -> None:
    """On the GPU the plan's estimate meets reality: a --gpu-memory-utilization leaving room for half
    the experts, then full prefill chunks and a full decode batch; what the GPU has in use (the CUDA
    context, kernel modules, cuBLAS workspaces and graph pools included) stays within U x its memory."""
    torch.cuda.empty_cache()  # what earlier tests left cached; the rest is counted by the plan as in use
    free, total = torch.cuda.mem_get_info()
    max_len = 512
    utilization = (total - free + fixed_bytes(MODEL, max_len) + ALL_EXPERTS // 2) / total
    core = EngineCore(EngineConfig(model=str(DEFAULT_MODEL), device="cuda", max_model_len=max_len,
                                   gpu_memory_utilization=utilization))
    try:
        assert core.runtime.runner.resident_experts < MODEL.num_moe_layers * MODEL.num_experts
        gen = torch.Generator().manual_seed(0)
        for i in range(64):
            prompt = tuple(torch.randint(3, MODEL.vocab_size, (200,), generator=gen).tolist())
            core.add_request(GenerateRequest(f"r{i}", prompt, SamplingParams(max_tokens=48, temperature=0)))
        while core.has_unfinished():
            core.step()
        free, total = torch.cuda.mem_get_info()
        breakdown = (f"in use {(total - free) / GIB:.3f} GiB: torch reserved {torch.cuda.memory_reserved() / GIB:.3f}, "
                     f"peak allocated {torch.cuda.max_memory_allocated() / GIB:.3f}; allowed {utilization * total / GIB:.3f}")
        print(breakdown)
        assert total - free <= utilization * total, breakdown
    finally:
        core.close()
