"""The peers' rows: transformers eager with every weight on the GPU, and accelerate's offload.

accelerate's `dispatch_model` keeps whole decoder layers on the CPU and copies each one's
weights to the GPU for every forward, so its PCIe bytes per token are the bytes of the
offloaded modules (reported as such, for its floor).
"""
from __future__ import annotations

import gc
from pathlib import Path

import torch

from bench.rows import RowResult, time_hf_decode


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def transformers_row(name: str, path: Path, prompts: list[list[int]], tokens: int, device: torch.device,
                     dtype: torch.dtype, deadline: float | None) -> RowResult:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    try:
        return time_hf_decode(name, model, prompts, tokens, device, deadline=deadline)
    finally:
        del model
        free_device()


def offloaded_bytes(model: torch.nn.Module, device_map: dict[str, int | str]) -> int:
    """Bytes of the parameters a device map leaves on the CPU (the longest matching prefix decides)."""
    total = 0
    for name, param in model.named_parameters():
        prefixes = [p for p in device_map if p == "" or name == p or name.startswith(p + ".")]
        if device_map[max(prefixes, key=len)] == "cpu":
            total += param.numel() * param.element_size()
    return total


def accelerate_row(name: str, path: Path, budget: str, prompts: list[list[int]], tokens: int,
                   dtype: torch.dtype, deadline: float | None) -> RowResult:
    """accelerate's big-model inference with `budget` of GPU memory; the rest on the CPU."""
    from accelerate import infer_auto_device_map, init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights():
        empty = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    device_map = infer_auto_device_map(empty, max_memory={0: budget, "cpu": "400GiB"},
                                       no_split_module_classes=empty._no_split_modules)
    moved = offloaded_bytes(empty, device_map)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map).eval()
    try:
        row = time_hf_decode(name, model, prompts, tokens, torch.device("cuda"), warmup_tokens=2, deadline=deadline)
    finally:
        del model
        free_device()
    row.extra["pcie_gb_per_token"] = moved / 1e9
    row.extra["pcie_bytes_source"] = "bytes of the modules the device map leaves on the CPU"
    return row
