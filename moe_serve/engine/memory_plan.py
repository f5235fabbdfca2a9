"""How the GPU's memory is shared at start-up: weights, activations, the paged KV cache and the expert cache.

`--gpu-memory-utilization U` gives the engine U x the GPU's total memory (vLLM's meaning). Taken
from it in order: what is already in use when the engine plans (its own CUDA context, measured,
and anything else on the GPU), the non-expert weights of the target (and of the draft), the
one-sequence caches of speculative decoding, a reserve for activations and the runtime (an
estimate; see `activation_bytes`); what is left is shared by the paged KV cache and the expert cache. `--kv-cache-memory` and
`--gpu-expert-budget` fix their part, and the other takes the rest. With neither fixed, everything
is resident when it fits; when it does not, the KV cache keeps at least a quarter of what is left
(and always room for one sequence of max_model_len), because every expert held on the GPU saves
PCIe copies while KV room past that only admits more concurrent sequences.

On a CPU there is no GPU memory to share: the KV cache defaults to room for max_num_seqs sequences
of max_model_len and every expert stays resident unless a budget says otherwise.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_serve.engine.config import ConfigError, EngineConfig, parse_budget, parse_bytes
from moe_serve.engine.kv.block_manager import blocks_for
from moe_serve.engine.kv.paged_cache import kv_bytes_per_token
from moe_serve.engine.models.blocks import CausalLM
from moe_serve.engine.models.config import ModelConfig

GIB = 2**30
# what the runtime adds after planning, beyond the activations: kernel modules loaded on first use
# (cuBLAS, Triton), cuBLAS workspaces, CUDA graph pools and the allocator's slack. Measured on the
# H100 with the default model (tests/engine/test_memory_plan.py's CUDA test): ~0.25 GiB of modules and
# workspaces outside torch's allocator beyond the context, ~0.17 GiB of pools beyond the tensors.
RUNTIME_RESERVE_BYTES = GIB // 2
KV_SHARE = 0.25  # of what is left after weights and reserves, kept for the KV cache when experts do not all fit


@dataclass(frozen=True)
class MemoryPlan:
    usable_bytes: int | None  # U x the GPU's memory; None on a CPU
    in_use_bytes: int  # in use on the GPU when the engine planned: its CUDA context, other processes
    weight_bytes: int  # non-expert weights, target and draft
    sequence_kv_bytes: int  # the contiguous one-sequence KV caches (speculative decoding, references)
    activation_bytes: int
    kv_bytes: int  # the paged KV cache (with a draft model, its paged cache too: same blocks)
    expert_bytes: int  # the expert cache
    all_expert_bytes: int
    one_expert_bytes: int  # one expert in its format: an expert slot of the cache

    @property
    def expert_slots(self) -> int:
        """Experts that fit in the expert cache at once."""
        return self.expert_bytes // self.one_expert_bytes if self.one_expert_bytes else 0

    @property
    def expert_budget(self) -> str | None:
        """As --gpu-expert-budget reads it: None when every expert is resident."""
        return None if self.expert_bytes >= self.all_expert_bytes else str(self.expert_bytes)

    def describe(self) -> str:
        parts = (f"in use at start-up {_gib(self.in_use_bytes)} + weights {_gib(self.weight_bytes)} + one-sequence KV {_gib(self.sequence_kv_bytes)} + "
                 f"activations {_gib(self.activation_bytes)} + paged KV {_gib(self.kv_bytes)} + experts "
                 f"{_gib(self.expert_bytes)} of {_gib(self.all_expert_bytes)} ({self.expert_slots} expert slots of "
                 f"{self.one_expert_bytes / 2**20:.1f} MiB)")
        if self.usable_bytes is None:
            return parts + " (on the cpu: --gpu-memory-utilization does not apply)"
        return f"{parts} = {_gib(self.total_bytes)} of the {_gib(self.usable_bytes)} --gpu-memory-utilization allows"

    @property
    def total_bytes(self) -> int:
        return (self.in_use_bytes + self.weight_bytes + self.sequence_kv_bytes + self.activation_bytes
                + self.kv_bytes + self.expert_bytes)


def plan_memory(config: EngineConfig, model: ModelConfig, draft: ModelConfig | None, dtype: torch.dtype,
                max_len: int, block_size: int, device_bytes: int | None, in_use_bytes: int = 0) -> MemoryPlan:
    """device_bytes: the GPU's total memory, None on a CPU; in_use_bytes: what is in use on it now.
    Raises ConfigError when the parts cannot fit."""
    models = (model,) if draft is None else (model, draft)
    # a draft model's paged cache has the target's blocks (batched speculation): a block holds both
    per_block = sum(kv_bytes_per_token(m, dtype) for m in models) * block_size
    one_sequence_kv = blocks_for(max_len, block_size) * per_block
    # an expert slot holds any layer's expert: the largest
    one_expert = max(layout.nbytes for layout in model.expert_layouts(dtype, config.expert_quant)) if model.is_moe else 0
    all_experts = model.num_moe_layers * model.num_experts * one_expert
    weights = sum(non_expert_bytes(m, dtype) for m in models)
    sequence_kv = sum(kv_bytes_per_token(m, dtype) * max_len for m in models)
    activations = 0 if device_bytes is None else activation_bytes(config, model, dtype)
    fixed_kv = None if config.kv_cache_memory is None else parse_bytes(config.kv_cache_memory)
    fixed_experts = _budget_bytes(config.gpu_expert_budget, all_experts)
    full_kv = config.max_num_seqs * one_sequence_kv
    parts = dict(weight_bytes=weights, sequence_kv_bytes=sequence_kv, activation_bytes=activations,
                 all_expert_bytes=all_experts, one_expert_bytes=one_expert)
    if device_bytes is None:
        return MemoryPlan(None, 0, kv_bytes=fixed_kv if fixed_kv is not None else full_kv,
                          expert_bytes=fixed_experts if fixed_experts is not None else all_experts, **parts)
    usable = int(device_bytes * config.gpu_memory_utilization)
    left = usable - in_use_bytes - weights - sequence_kv - activations
    if fixed_kv is not None and fixed_experts is not None:
        kv, experts = fixed_kv, fixed_experts
    elif fixed_experts is not None:
        experts = fixed_experts
        kv = min(full_kv, left - experts)
    else:
        kv_kept = fixed_kv if fixed_kv is not None else min(full_kv, max(one_sequence_kv, int(KV_SHARE * left)))
        experts = min(all_experts, left - kv_kept)
        kv = kv_kept if fixed_kv is not None else min(full_kv, left - experts)
    plan = MemoryPlan(usable, in_use_bytes, kv_bytes=kv, expert_bytes=experts, **parts)
    _check(plan, one_sequence_kv, max_len)
    return plan


def _check(plan: MemoryPlan, one_sequence_kv: int, max_len: int) -> None:
    if plan.kv_bytes < one_sequence_kv:
        raise ConfigError(f"the KV cache gets {_gib(plan.kv_bytes)}, less than one sequence of max_model_len "
                          f"{max_len} needs ({_gib(one_sequence_kv)}): {plan.describe()}; lower --max-model-len, "
                          "--gpu-expert-budget or raise --gpu-memory-utilization")
    if plan.expert_bytes <= 0:
        raise ConfigError(f"no GPU memory is left for experts: {plan.describe()}; lower --max-model-len, "
                          "--kv-cache-memory or raise --gpu-memory-utilization")


def _budget_bytes(budget: str | None, all_experts: int) -> int | None:
    if budget is None:
        return None
    value = parse_budget(budget)
    return int(value * all_experts) if isinstance(value, float) else value


def non_expert_bytes(model: ModelConfig, dtype: torch.dtype) -> int:
    """Every parameter and buffer but the routed experts, counted on the meta device (no memory)."""
    # the runner is only stored at construction, never called on the meta device
    meta = CausalLM(model, object() if model.is_moe else None, device="meta", dtype=dtype)  # type: ignore[arg-type]
    tensors = [*meta.parameters(), *meta.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def activation_bytes(config: EngineConfig, model: ModelConfig, dtype: torch.dtype) -> int:
    """An estimate, not a profile: one step's max_num_batched_tokens through the widest layer (hidden
    states, q/k/v, the routed experts' intermediates), fp32 logits for max_num_seqs sampled rows, plus
    RUNTIME_RESERVE_BYTES."""
    widest_mlp = max(model.intermediate_size, model.top_k * model.moe_intermediate_size)
    per_token = dtype.itemsize * (8 * model.hidden_size + 3 * widest_mlp)
    logits = 4 * model.vocab_size * config.max_num_seqs
    return config.max_num_batched_tokens * per_token + logits + RUNTIME_RESERVE_BYTES


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / 2**20:.1f} MiB"
