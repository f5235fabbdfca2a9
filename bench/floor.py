"""The floor of one bs=1 decode step: bytes it must read on the GPU and bytes it must copy over PCIe.

    floor = max(HBM bytes per token / HBM bandwidth, PCIe bytes per token / host->device bandwidth)

HBM bytes are what any implementation must read for one token: every non-expert weight (the
input embedding only as one row; a tied embedding once, as the LM head), the top-k experts of
every MoE layer, and the KV cache so far. PCIe bytes are what the run actually copied (its
measured counter), so the floor says how close the run came to the copies it chose to make.
Both bandwidths are measured in the same device call as the rows they judge.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from moe_serve.engine.loader import checkpoint_files, read_config
from moe_serve.engine.timing import median_seconds

ROUTED_EXPERT = re.compile(r"\.experts\.")  # per-expert (experts.N.w1) and fused (experts.gate_up_proj); not shared_expert
INPUT_EMBEDDING = re.compile(r"embed_tokens\.weight$")


@dataclass(frozen=True)
class Bandwidths:
    hbm_bytes_per_s: float  # device-to-device copy: bytes read + bytes written, per second
    h2d_bytes_per_s: float  # pinned host -> device copy of one expert-sized buffer
    h2d_buffer_bytes: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode token must read on the GPU, at the run's dtype."""
    non_expert: int
    active_experts: int  # num_moe_layers * top_k * expert_bytes
    kv: int  # K and V of every layer over the mean context of the decode
    expert_bytes: int  # one routed expert
    all_experts: int  # every routed expert of the model

    @property
    def total(self) -> int:
        return self.non_expert + self.active_experts + self.kv

    def as_dict(self) -> dict:
        return asdict(self) | {"total": self.total}


def measure_bandwidths(device: torch.device, h2d_bytes: int, d2d_bytes: int = 2**30, repeats: int = 10) -> Bandwidths:
    """Median of `repeats` copies each; on CPU both figures are host memcpy (smoke runs only)."""
    src = torch.randn(d2d_bytes // 4, device=device)  # random, not zeros: the data must not help
    dst = torch.empty_like(src)
    hbm = 2 * d2d_bytes / median_seconds(lambda: dst.copy_(src), device, repeats)
    src = dst = None  # free the 2 GiB before allocating the host buffer
    pin = device.type == "cuda"
    host = torch.randint(0, 255, (h2d_bytes,), dtype=torch.uint8).pin_memory() if pin else \
        torch.randint(0, 255, (h2d_bytes,), dtype=torch.uint8)
    target = torch.empty(h2d_bytes, dtype=torch.uint8, device=device)
    h2d = h2d_bytes / median_seconds(lambda: target.copy_(host, non_blocking=pin), device, repeats)
    return Bandwidths(hbm_bytes_per_s=hbm, h2d_bytes_per_s=h2d, h2d_buffer_bytes=h2d_bytes)


def _tensor_numels(model_dir: str | Path) -> dict[str, int]:
    numels = {}
    for file in checkpoint_files(model_dir):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                numels[key] = int(torch.Size(f.get_slice(key).get_shape()).numel())
    return numels


def step_bytes(model_dir: str | Path, dtype: torch.dtype, context_tokens: float, expert_quant: str = "none") -> StepBytes:
    """What one decode token reads at `dtype`, its experts in the --expert-quant format `expert_quant`,
    when the KV cache holds `context_tokens` positions."""
    config = read_config(model_dir)
    element = torch.empty((), dtype=dtype).element_size()
    numels = _tensor_numels(model_dir)
    untied = any(k.endswith("lm_head.weight") for k in numels)
    non_expert = sum(n for k, n in numels.items()
                     if not ROUTED_EXPERT.search(k) and not (untied and INPUT_EMBEDDING.search(k)))
    non_expert += config.hidden_size if untied else 0  # the one embedding row a token reads
    expert = config.expert_layout(dtype, expert_quant).nbytes if config.is_moe else 0
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * element  # K and V
    return StepBytes(non_expert=non_expert * element, active_experts=config.num_moe_layers * config.top_k * expert,
                     kv=int(kv_per_token * context_tokens), expert_bytes=expert,
                     all_experts=config.num_moe_layers * config.num_experts * expert)


def floor_seconds(step: StepBytes, pcie_bytes_per_token: float, bw: Bandwidths) -> dict:
    """The floor of one decode token and which side sets it."""
    hbm = step.total / bw.hbm_bytes_per_s
    pcie = pcie_bytes_per_token / bw.h2d_bytes_per_s
    return {"floor_s": max(hbm, pcie), "hbm_s": hbm, "pcie_s": pcie, "bound": "pcie" if pcie > hbm else "hbm"}
