"""Stream a local HF safetensors checkpoint into an ExpertStore (routed experts) and a CausalLM
(everything else), one tensor at a time, so the model is never held twice in RAM or on the GPU.

Order: (0) map every tensor name through the family's rules, failing on unknown names before
reading any data; (1) stream routed experts into the store; (2) let the caller build the
ExpertRunner over the filled store; (3) build the model around it on the device and stream the
remaining tensors into its parameters. Any missing, unexpected, duplicated or mis-shaped tensor
raises LoadError naming it.

A quantized checkpoint (config.json's quantization_config; quantized_checkpoints/) stores a
weight as several tensors named by suffix: step (0) groups them under the weight's name and checks
each group is complete; a group is read as one, its routed experts kept in their published
format, its other weights dequantized to the model's dtype.

A GGUF file (gguf/) is the other kind of Checkpoint: its own config, name rules and reader, the
same steps (0)-(3).
"""
from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Protocol

import torch
from safetensors import safe_open
from tqdm import tqdm

from moe_serve.engine.experts.routing import ExpertRunner
from moe_serve.engine.experts.store import ExpertStore
from moe_serve.engine.gguf import is_gguf
from moe_serve.engine.models.blocks import CausalLM
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.models.family import EXPERT_PREFIX, TensorRule
from moe_serve.engine.models.registry import FAMILIES
from moe_serve.engine.models.rope import pairs_to_halves_rows
from moe_serve.engine.quantized_checkpoints import checkpoint_quant
from moe_serve.engine.quantized_checkpoints.base import CheckpointQuant

log = logging.getLogger(__name__)
RunnerFactory = Callable[[ExpertStore, ModelConfig], ExpertRunner]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
           "half": torch.float16, "fp32": torch.float32, "float32": torch.float32, "float": torch.float32}
_EXPERT_PARTS = ("gate", "up", "down")
_EXPERT_BIAS_PARTS = ("gate_bias", "up_bias", "down_bias")
_FUSED_HALVES = {"gate_up": ("gate", "up"), "gate_up_bias": ("gate_bias", "up_bias")}  # a fused part's halves
_FLOAT_DTYPES = ("F16", "BF16", "F32")  # safetensors' names of the dtypes a weight computes in


class LoadError(ValueError):
    """The checkpoint does not match the model its config.json describes."""


class LoadedModel(NamedTuple):
    model: CausalLM
    store: ExpertStore | None  # None for dense models
    config: ModelConfig


class EncodedWeight(NamedTuple):
    """A routed expert weight already in the expert format's encoding, as the checkpoint publishes it."""
    data: torch.Tensor
    scales: torch.Tensor | None


@dataclass(frozen=True)
class TensorTarget:
    hf_name: str  # the tensor's name in the checkpoint
    file: Path
    ours: str  # parameter name, or "expert.<part>"
    part: str | None
    layer: int | None  # decoder layer from {L}
    expert: int | None  # from {E}; None for fused expert tensors
    # a quantized weight: role -> (file, tensor name) of each of its tensors; None: one plain tensor
    quantized: tuple[tuple[str, Path, str], ...] | None = None
    interleaved: bool = False  # TensorRule's: gate and up rows alternate
    in_by_out: bool = False  # TensorRule's: a float tensor is [.., K, N]

    @property
    def is_expert(self) -> bool:
        return self.ours.startswith(EXPERT_PREFIX)


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device | str) -> torch.dtype:
    """None -> bf16 on cuda, fp32 elsewhere; names like 'bf16' or 'float32' accepted."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} not in {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def read_hf_config(path: str | Path) -> dict:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise LoadError(f"{config_file} not found")
    return json.loads(config_file.read_text())


def read_config(path: str | Path) -> ModelConfig:
    return open_checkpoint(path).config


Tensors = Iterator[tuple[TensorTarget, torch.Tensor | dict[str, torch.Tensor] | EncodedWeight]]


class Checkpoint(Protocol):
    """What load_model reads: the model's config, the rules the tensor names map by, every tensor
    mapped to its target before any data is read, then the targets' tensors one at a time (a plain
    tensor, a quantized weight's tensors by role for `quant`, or an EncodedWeight)."""
    config: ModelConfig
    quant: CheckpointQuant | None
    rules: tuple[TensorRule, ...]

    def targets(self) -> list[TensorTarget]: ...

    def tensors(self, targets: list[TensorTarget], bar: tqdm) -> Tensors: ...


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A Hugging Face checkpoint folder, or a GGUF file (gguf/checkpoint.py)."""
    if is_gguf(path):
        from moe_serve.engine.gguf.checkpoint import GgufCheckpoint  # reads the file's header now

        return GgufCheckpoint(Path(path))
    return SafetensorsCheckpoint(Path(path))


class SafetensorsCheckpoint:
    """A Hugging Face checkpoint folder: config.json and its safetensors files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        hf = read_hf_config(path)
        self.config, self.quant = ModelConfig.from_hf(hf), checkpoint_quant(hf)
        self.rules = FAMILIES[self.config.architecture].rules

    def targets(self) -> list[TensorTarget]:
        return _plan(checkpoint_files(self.path), self.rules, self.quant, _unrun_layer_names(self.config))

    def tensors(self, targets: list[TensorTarget], bar: tqdm) -> Tensors:
        return _tensors(targets, bar)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint dir: the shards an index names, or model.safetensors."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [path / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    elif (path / "model.safetensors").is_file():
        files = [path / "model.safetensors"]
    else:
        raise LoadError(f"no model.safetensors or model.safetensors.index.json in {path}")
    for file in files:
        if not file.is_file():
            raise LoadError(f"shard {file} named by the index is missing")
    return files


def load_model(
    path: str | Path | Checkpoint,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | str | None = None,
    *,
    runner_factory: RunnerFactory | None = None,
    progress: bool = True,
    expert_quant: str = "none",
) -> LoadedModel:
    """Load a local HF checkpoint dir or GGUF file, or one already opened (a GGUF's header is parsed
    once, tokenizer strings and all: seconds for a large vocabulary); runner_factory(store, config)
    is required for MoE models. `expert_quant`: the format the routed experts are encoded in as they
    stream into the store (moe_serve/engine/experts/formats/); every other weight keeps `dtype`."""
    checkpoint = open_checkpoint(path) if isinstance(path, (str, Path)) else path
    config, quant, rules = checkpoint.config, checkpoint.quant, checkpoint.rules
    dtype = resolve_dtype(dtype, device)
    if config.is_moe and runner_factory is None:
        raise ValueError(f"{config.architecture} is an MoE model: pass runner_factory")
    targets = checkpoint.targets()
    log.info("loading weights: %d tensors from %s", len(targets), path)
    started = time.monotonic()
    # a bar only on a terminal (disable=None): in a log file its carriage returns are noise
    with tqdm(total=len(targets), desc="loading weights", unit="tensor", disable=None if progress else True) as bar:
        store = runner = None
        if config.is_moe:
            layouts = config.expert_layouts(dtype, expert_quant)
            store = ExpertStore.for_device(config.num_moe_layers, config.num_experts, layouts, device)
            _load_experts(store, config, rules, quant, checkpoint.tensors([t for t in targets if t.is_expert], bar))
            runner = runner_factory(store, config)
        model = CausalLM(config, runner, device=device, dtype=dtype)
        _load_params(model, config, rules, quant, checkpoint.tensors([t for t in targets if not t.is_expert], bar))
    log.info("weights loaded in %.1f s", time.monotonic() - started)
    return LoadedModel(model.eval(), store, config)


def _compile(rule: TensorRule) -> re.Pattern[str]:
    pattern = re.escape(rule.hf).replace(r"\{L\}", r"(?P<L>\d+)").replace(r"\{E\}", r"(?P<E>\d+)")
    return re.compile(pattern + "$")


def _unrun_layer_names(config: ModelConfig) -> re.Pattern[str] | None:
    """The names of the decoder layers past the last one that the config says are not run."""
    if not config.unrun_layers:
        return None
    numbers = "|".join(str(config.num_layers + i) for i in range(config.unrun_layers))
    return re.compile(rf"model\.layers\.({numbers})\.")


def _plan(files: list[Path], rules: tuple[TensorRule, ...], quant: CheckpointQuant | None,
          unrun: re.Pattern[str] | None = None) -> list[TensorTarget]:
    """Every tensor name in the checkpoint mapped to its target, a quantized weight's tensors grouped
    into one (names `unrun` matches skipped); unknown names and incomplete groups fail here, before
    any data is read."""
    compiled = [(rule, _compile(rule)) for rule in rules]
    targets: list[TensorTarget] = []
    groups: dict[str, dict[str, tuple[Path, str]]] = {}  # weight name -> role -> (file, tensor name)
    float_weights: set[str] = set()  # tensors a module left unquantized may be
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if unrun is not None and unrun.match(name):
                    continue
                found = _quantized_part(name, quant, compiled)
                if found is None:
                    targets.append(_match(name, file, compiled))
                    continue
                weight, role = found
                if role in groups.setdefault(weight, {}):
                    raise LoadError(f"duplicate tensor {name!r}")
                groups[weight][role] = (file, name)
                if f.get_slice(name).get_dtype() in _FLOAT_DTYPES:
                    float_weights.add(name)
    for weight, parts in groups.items():
        if set(parts) == {"weight"} and parts["weight"][1] in float_weights:  # a module left unquantized
            targets.append(_match(*reversed(parts["weight"]), compiled))
            continue
        missing = [quant.suffixes[role] for role in quant.suffixes if role not in parts]
        if missing:
            stem = weight.removesuffix(".weight")
            raise LoadError(f"missing tensor {stem + missing[0]!r} of a {quant.method}-quantized weight")
        target = _match(weight, next(iter(parts.values()))[0], compiled)
        targets.append(replace(target, quantized=tuple((role, *where) for role, where in parts.items())))
    return targets


def _quantized_part(name: str, quant: CheckpointQuant | None,
                    rules: list[tuple[TensorRule, re.Pattern[str]]]) -> tuple[str, str] | None:
    """(the weight's name as the rules know it, role) when `name` is one tensor of a quantized weight."""
    if quant is None:
        return None
    for role, suffix in sorted(quant.suffixes.items(), key=lambda item: -len(item[1])):
        if name.endswith(suffix):
            stem = name.removesuffix(suffix)
            for weight in (stem + ".weight", stem):  # linear weights, and fused expert tensors
                if any(pattern.match(weight) for _, pattern in rules):
                    return weight, role
    return None


def map_names(names: list[str], file: Path, rules: tuple[TensorRule, ...]) -> list[TensorTarget]:
    """Each tensor name mapped to its target by the rules; LoadError naming one no rule maps."""
    compiled = [(rule, _compile(rule)) for rule in rules]
    return [_match(name, file, compiled) for name in names]


def _match(name: str, file: Path, rules: list[tuple[TensorRule, re.Pattern[str]]]) -> TensorTarget:
    for rule, pattern in rules:
        m = pattern.match(name)
        if m:
            groups = m.groupdict()
            layer = int(groups["L"]) if "L" in groups else None
            expert = int(groups["E"]) if "E" in groups else None
            ours = rule.ours.replace("{L}", str(layer))
            return TensorTarget(name, file, ours, rule.part, layer, expert, interleaved=rule.interleaved,
                                in_by_out=rule.in_by_out)
    raise LoadError(f"unexpected tensor {name!r} in {file.name}: no rule of this family maps it")


def _tensors(targets: list[TensorTarget], bar: tqdm) -> Tensors:
    """Read targets one at a time, opening each file once: a plain target's tensor, a quantized
    one's tensors by role (those in other files opened when its group is read)."""
    by_file: dict[Path, list[TensorTarget]] = {}
    for target in targets:
        by_file.setdefault(target.file, []).append(target)
    for file, file_targets in by_file.items():
        with safe_open(file, framework="pt") as f:
            for target in file_targets:
                if target.quantized is None:
                    yield target, f.get_tensor(target.hf_name)
                else:
                    yield target, {role: _read(f, file, where, name) for role, where, name in target.quantized}
                bar.update()


def _read(opened, opened_file: Path, file: Path, name: str) -> torch.Tensor:
    if file == opened_file:
        return opened.get_tensor(name)
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name)


def _load_experts(
    store: ExpertStore, config: ModelConfig, rules: tuple[TensorRule, ...], quant: CheckpointQuant | None,
    tensors: Tensors
) -> None:
    filled: set[tuple[int, int, str]] = set()
    for target, tensor in tensors:
        moe = config.moe_index(target.layer)
        if moe is None:
            raise LoadError(f"unexpected tensor {target.hf_name!r}: layer {target.layer} is not an MoE layer")
        part = target.ours.removeprefix(EXPERT_PREFIX)
        experts = range(config.num_experts) if target.expert is None else [target.expert]
        if target.expert is not None and target.expert >= config.num_experts:
            raise LoadError(f"unexpected tensor {target.hf_name!r}: expert {target.expert} >= {config.num_experts}")
        keys = {(moe, e, p) for e in experts for p in _FUSED_HALVES.get(part, (part,))}
        if keys & filled:
            raise LoadError(f"duplicate tensor {target.hf_name!r}: its experts were already loaded")
        filled |= keys
        try:
            if isinstance(tensor, dict):
                tensor = EncodedWeight(*quant.expert_parts(tensor, store.layouts[moe].format_of("down" if part == "down" else "gate_up")))
            tensor = _as_our_rows(tensor, target)
            if isinstance(tensor, EncodedWeight):
                store.put_encoded(moe, target.expert, part, tensor.data, tensor.scales)
            elif target.expert is None:
                store.put_fused(moe, **{part: tensor})
            else:
                store.put(moe, target.expert, **{part: tensor})
        except ValueError as e:
            raise LoadError(f"tensor {target.hf_name!r}: {e}") from None
    parts = _EXPERT_PARTS + (_EXPERT_BIAS_PARTS if config.expert_biases else ())
    expected = {(m, e, p) for m in range(config.num_moe_layers) for e in range(config.num_experts) for p in parts}
    missing = sorted(expected - filled)
    if missing:
        m, e, p = missing[0]
        fused = next((f for f, halves in _FUSED_HALVES.items() if p in halves), p)
        # per-expert names first, where a family has both; else the fused tensor holding the part
        rule = next(r for r in rules if r.ours in (EXPERT_PREFIX + p, EXPERT_PREFIX + fused))
        name = rule.hf.replace("{L}", str(config.moe_layers[m])).replace("{E}", str(e))
        raise LoadError(f"missing tensor {name!r} ({len(missing)} expert weights missing)")


def _as_our_rows(tensor: torch.Tensor | EncodedWeight, target: TensorTarget) -> torch.Tensor | EncodedWeight:
    """An expert tensor as our rows: a float [.., K, N] one transposed, alternating gate and up rows
    (or bias entries: dim -1 of a vector, -2 of a matrix; an encoding's data and scales alike) put
    gate rows first."""
    if isinstance(tensor, EncodedWeight):
        if target.interleaved:
            return EncodedWeight(*(None if t is None else _gate_rows_first(t, -2) for t in tensor))
        return tensor
    if target.in_by_out:
        tensor = tensor.transpose(-1, -2)
    if target.interleaved:
        tensor = _gate_rows_first(tensor, -1 if target.ours.endswith("_bias") else -2)
    return tensor


def _gate_rows_first(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Entries 0, 2, 4, ... (gate) then 1, 3, 5, ... (up) along dim."""
    rows = t.movedim(dim, 0)
    return torch.cat([rows[0::2], rows[1::2]]).movedim(0, dim)


def _part_rows(config: ModelConfig, param: torch.Tensor, part: str | None) -> slice:
    """Rows of a fused parameter that one HF tensor fills."""
    if part is None:
        return slice(None)
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    half = param.shape[0] // 2
    starts = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (0, half), "up": (half, half)}
    start, size = starts[part]
    return slice(start, start + size)


def _load_params(
    model: CausalLM, config: ModelConfig, rules: tuple[TensorRule, ...], quant: CheckpointQuant | None,
    tensors: Tensors
) -> None:
    params = dict(model.named_parameters())
    filled: set[tuple[str, str | None]] = set()
    for target, tensor in tensors:
        if isinstance(tensor, dict):
            try:
                tensor = quant.dequantize(tensor, model.dtype)
            except ValueError as e:
                raise LoadError(f"tensor {target.hf_name!r}: {e}") from None
        if config.tie_word_embeddings and target.ours == "lm_head.weight":
            continue  # some checkpoints also store the tied copy
        if target.ours not in params:
            raise LoadError(f"unexpected tensor {target.hf_name!r}: this config has no {target.ours}")
        key = (target.ours, target.part)
        if key in filled:
            raise LoadError(f"duplicate tensor {target.hf_name!r}")
        dst = params[target.ours][_part_rows(config, params[target.ours], target.part)]
        if config.rope_interleaved and target.part in ("q", "k"):
            tensor = pairs_to_halves_rows(tensor, config.num_heads if target.part == "q" else config.num_kv_heads)
        if config.mla is not None and config.mla.rope_interleaved:
            tensor = _latent_rope_halves(tensor, target.ours, config)
        if dst.shape != tensor.shape and tensor.shape == (1, *dst.shape):  # a vector saved as [1, N] (ERNIE's)
            tensor = tensor[0]
        if dst.shape != tensor.shape:
            raise LoadError(f"tensor {target.hf_name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        filled.add(key)
    missing = sorted(_expected_params(params) - filled, key=str)
    if missing:
        names = [_hf_name(name, part, rules) for name, part in missing[:5]]
        raise LoadError(f"missing tensors {', '.join(names)} ({len(missing)} missing)")


def _latent_rope_halves(tensor: torch.Tensor, ours: str, config: ModelConfig) -> torch.Tensor:
    """DeepSeek's roped dims from adjacent pairs to halves, in the rows that make them: each head's last
    qk_rope_head_dim rows of q (q_b), and kv_a's last ones (the shared roped key). Once here instead of
    on the queries and keys of every forward; q.k is the same with both reordered."""
    rope = config.mla.qk_rope_head_dim
    if ours.endswith((".attn.q.weight", ".attn.q_b.weight")):
        heads, rest = config.num_heads, tensor.shape[1:]
        rows = tensor.reshape(heads, -1, *rest)  # [n, nope + rope, ...]
        roped = pairs_to_halves_rows(rows[:, -rope:].reshape(heads * rope, *rest), heads)
        return torch.cat([rows[:, :-rope], roped.reshape(heads, rope, *rest)], dim=1).reshape(tensor.shape)
    if ours.endswith((".attn.kv_a.weight", ".attn.kv_a.bias")):
        return torch.cat([tensor[:-rope], pairs_to_halves_rows(tensor[-rope:], 1)])
    return tensor


def _hf_name(ours: str, part: str | None, rules: tuple[TensorRule, ...]) -> str:
    """The first HF name the rules map to our (parameter, part): to name a missing tensor."""
    layer = re.match(r"layers\.(\d+)\.", ours)
    for rule in rules:
        candidate = rule.ours.replace("{L}", layer.group(1)) if layer else rule.ours
        if candidate == ours and rule.part == part:
            return repr(rule.hf.replace("{L}", layer.group(1)) if layer else rule.hf)
    return f"{ours}[{part}]"


def _expected_params(params: dict[str, torch.Tensor]) -> set[tuple[str, str | None]]:
    expected: set[tuple[str, str | None]] = set()
    for name in params:
        if ".attn.qkv." in name:
            expected |= {(name, p) for p in "qkv"}
        elif ".gate_up." in name:
            expected |= {(name, "gate"), (name, "up")}
        else:
            expected.add((name, None))
    return expected
