"""Widen every expert of a Qwen3-MoE checkpoint to real-world byte sizes, same function.

Each expert's intermediate dimension grows from I to N by appending
  gate_proj rows of zeros     (SiLU(0) = 0, so the new units are always off),
  up_proj rows of noise       (they multiply that zero),
  down_proj columns of noise  (they read that zero),
so the logits do not change while every expert costs N/I times the bytes to copy and compute:
a benchmark-scale model of the trained default target (hidden size stays the trained one).
Streams tensor by tensor into sharded safetensors; generated where a benchmark needs it,
never committed.

  python scripts/expand_experts.py --src moe_serve/models/default --dst /tmp/default-olmoe --expert-mb 12.6
  python scripts/expand_experts.py --src moe_serve/models/default --dst /tmp/default-mixtral --expert-mb 352
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

EXPERT_KEY = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$")
MB = 1_000_000  # OLMoE's 12.6 MB and Mixtral's 352 MB experts are decimal megabytes in bf16
ROUND_TO = 128  # widths that tile well: OLMoE's 1024 and Mixtral's 14336 are multiples


def intermediate_for_expert_mb(expert_mb: float, hidden_size: int, dtype_bytes: int = 2) -> int:
    """The intermediate size whose three [I, H] matrices take expert_mb, rounded to ROUND_TO."""
    units = expert_mb * MB / (3 * hidden_size * dtype_bytes)
    return max(ROUND_TO, round(units / ROUND_TO) * ROUND_TO)


def widen(key: str, w: torch.Tensor, new_size: int, gen: torch.Generator) -> torch.Tensor:
    kind = EXPERT_KEY.search(key).group(1)
    old_size = w.shape[1] if kind == "down_proj" else w.shape[0]
    extra = new_size - old_size
    if kind == "gate_proj":
        return torch.cat([w, torch.zeros(extra, w.shape[1], dtype=w.dtype)])  # [N, H]
    noise_shape = (w.shape[0], extra) if kind == "down_proj" else (extra, w.shape[1])
    noise = (torch.randn(noise_shape, generator=gen) * w.float().std()).to(w.dtype)
    return torch.cat([w, noise], dim=1 if kind == "down_proj" else 0)  # [H, N] or [N, H]


def source_tensors(src: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a checkpoint, sharded or not, in a fixed (sorted) order."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        with safe_open(src / "model.safetensors", "pt") as f:
            weight_map = {key: "model.safetensors" for key in f.keys()}
    for key in sorted(weight_map):
        with safe_open(src / weight_map[key], "pt") as f:
            yield key, f.get_tensor(key)


class ShardWriter:
    """Writes tensors into shards of at most max_bytes, then the HF index."""

    def __init__(self, dst: Path, max_bytes: int):
        self.dst, self.max_bytes = dst, max_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, key: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending[key] = tensor.contiguous()
        self.pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, self.dst / f"shard-{len(self.shards)}.tmp", metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> int:
        """Names the shards model-0000i-of-0000n and writes the index; returns the shard count."""
        if self.pending:
            self._flush()
        n = len(self.shards)
        weight_map = {}
        for i, keys in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            (self.dst / f"shard-{i}.tmp").rename(self.dst / name)
            weight_map |= dict.fromkeys(keys, name)
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.dst / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return n


def expand(src: Path, dst: Path, new_size: int, seed: int, max_shard_bytes: int) -> dict:
    config = json.loads((src / "config.json").read_text())
    if config["model_type"] != "qwen3_moe":
        raise ValueError(f"expects a qwen3_moe checkpoint, got {config['model_type']}")
    if new_size < config["moe_intermediate_size"]:
        raise ValueError(f"--intermediate-size {new_size} < the trained {config['moe_intermediate_size']}")
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():  # tokenizer, generation config, chat template
        if path.is_file() and not path.name.startswith("model") and path.name != "config.json":
            shutil.copy2(path, dst / path.name)
    gen = torch.Generator().manual_seed(seed)
    writer = ShardWriter(dst, max_shard_bytes)
    for key, tensor in source_tensors(src):
        writer.add(key, widen(key, tensor, new_size, gen) if EXPERT_KEY.search(key) else tensor)
    shards = writer.close()
    (dst / "config.json").write_text(json.dumps(config | {"moe_intermediate_size": new_size}, indent=2))
    expert_bytes = 3 * config["hidden_size"] * new_size * 2
    return {"dst": str(dst), "moe_intermediate_size": new_size, "expert_bytes_bf16": expert_bytes,
            "total_bytes": writer.total_bytes, "shards": shards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True)
    parser.add_argument("--dst", type=Path, required=True)
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--intermediate-size", type=int)
    size.add_argument("--expert-mb", type=float, help="bf16 bytes per expert, in 10^6: 12.6 (OLMoE), 352 (Mixtral)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-mb", type=float, default=4000)
    args = parser.parse_args()
    hidden = json.loads((args.src / "config.json").read_text())["hidden_size"]
    new_size = args.intermediate_size or intermediate_for_expert_mb(args.expert_mb, hidden)
    print(json.dumps(expand(args.src, args.dst, new_size, args.seed, int(args.max_shard_mb * MB))))


if __name__ == "__main__":
    main()
