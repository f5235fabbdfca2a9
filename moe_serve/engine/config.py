"""Runtime settings of the engine (fixed at start-up; the model's own shape is in engine/models/config.py)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from moe_serve.engine.logging_config import LogSettings

if TYPE_CHECKING:
    from moe_serve.engine.models.config import ModelConfig

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNIT = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
         "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str) -> int:
    """'512MiB', '2GB', '4096' -> bytes."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r}: expected a size such as 512MiB or 2GB")
    return int(float(m.group(1)) * _UNIT[(m.group(2) or "").lower().rstrip("b")])


def parse_budget(text: str) -> float | int:
    """'3GiB' -> bytes (int); '0.25' or '25%' -> fraction of all expert bytes (float in (0, 1]).

    Plain numbers above 1 are bytes.
    """
    s = text.strip()
    if s.endswith("%"):
        frac = float(s[:-1]) / 100
        if not 0 < frac <= 1:
            raise ValueError(f"expert budget {text!r}: a percentage must be in (0, 100]")
        return frac
    m = _SIZE.match(s)
    if not m:
        raise ValueError(f"expert budget {text!r}: expected e.g. 3GiB, 512MB, 25% or 0.25")
    value, unit = float(m.group(1)), (m.group(2) or "").lower().rstrip("b")
    if unit == "" and value <= 1 and "." in m.group(1):
        return value
    return int(value * _UNIT[unit])


class ConfigError(ValueError):
    """A setting this model or this machine cannot honour: reported in one line, without a traceback."""


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # a tokenizer folder (or GGUF file) other than the model's: the server's text and the engine's grammars read it
    tokenizer: str | None = None
    device: str = "cpu"
    dtype: str | None = None  # None: bf16 on cuda, fp32 on cpu
    gpu_expert_budget: str | None = None  # None: what --gpu-memory-utilization leaves (moe_serve/engine/memory_plan.py)
    # the share of the GPU's memory this engine plans with: weights, activations, KV cache and expert cache
    gpu_memory_utilization: float = 0.9
    # which expert to evict: next-use (estimated next use furthest away, moe_serve/engine/experts/policies.py)
    # moved fewest bytes in every routing replay and beat LRU by 1.16x at Mixtral size on the GPU
    cache_policy: str = "next-use"  # next-use | lru | lfu | mrs
    prefetch: str = "none"  # none | next-layer
    prefetch_depth: int = 1  # layers ahead the next-layer predictor looks
    cpu_experts: str = "off"  # off | auto: run a missed expert on the CPU when the start-up profile says it wins
    expert_quant: str = "none"  # none | int8 | int4 | fp8: routed experts quantized at load (moe_serve/engine/experts/formats/)
    max_model_len: int | None = None  # None: the model's own context length (resolve_max_model_len)
    # continuous batching (moe_serve/engine/scheduler.py): sequences per step, tokens per step (decodes plus
    # prefill chunks), and the paged KV cache's size (None: moe_serve/engine/memory_plan.py sizes it)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str | None = None
    record_routing: str | None = None
    spec: str = "off"  # off | self | draft
    draft: str | None = None
    spec_tokens: int = 8  # gamma: 8 beat 4 in both default-model tables (bench/results, README)
    spec_top_r: int = 1
    spec_confidence: float = 0.0
    spec_cutoff: int | None = None
    spec_adaptive_accept: float | None = None  # SS-MoE tolerance T: lossy, opt-in only
    spec_adaptive_tokens: bool = False  # per-request gamma from recent acceptance
    spec_switch: str = "measured"  # measured | always: when a step that may speculate does (speculative/switch.py)
    cuda_graphs: bool = True  # replay short forwards (decode, draft, verify) as CUDA graphs (moe_serve/engine/graphs.py)
    trust_remote_code: bool = False
    logging: LogSettings = field(default_factory=LogSettings)  # the engine process sets up its own logging

    @property
    def tokenizer_path(self) -> str:
        """Where the tokenizer is: --tokenizer's folder, else the model's folder or GGUF file."""
        return self.tokenizer or self.model


def model_context_length(model: ModelConfig) -> int:
    """The longest context the model supports: max_position_embeddings, stretched by a RoPE scaling
    that extends it (vLLM's rule: yarn reaches original x factor, linear and dynamic NTK max x factor;
    llama3 checkpoints already state their extended length)."""
    rope, length = model.rope, model.max_position_embeddings
    if rope.rope_type == "yarn" and rope.original_max_position_embeddings:
        return max(length, int(rope.original_max_position_embeddings * rope.factor))
    if rope.rope_type in ("linear", "dynamic"):
        return int(length * rope.factor)
    return length


def resolve_max_model_len(requested: int | None, model: ModelConfig) -> int:
    """--max-model-len: the model's own length when unset; longer than the model supports is an error."""
    allowed = model_context_length(model)
    if requested is None:
        return allowed
    if requested > allowed:
        raise ConfigError(f"--max-model-len {requested} is longer than this model's context length {allowed} "
                          f"(max_position_embeddings {model.max_position_embeddings}, rope {model.rope.rope_type}); "
                          f"leave it unset to use {allowed}")
    return requested
