"""A GGUF file as load_model reads it (loader.Checkpoint): llama.cpp's tensor names mapped onto our
parameters, and each tensor read from the memory-mapped file when the loader asks for it.

Routed experts (ffn_{gate,up,down}_exps, [E, N, K] with K along each row) stay in their GGML block
type when an expert format keeps it (experts/formats/q8_0.py, legacy_quants.py, k_quants.py, iq4.py):
the rows of the file are the rows of our expert layout, copied as they are. MXFP4's are re-laid into
experts/formats/mxfp4.py's layout, the same codes and scale bytes (_mxfp4_rows): the kernels read GGML's
17-byte blocks a byte at a time, 2-4x slower than bf16 on an H200, and mxfp4.py's words at one token
1.35-1.6x faster than bf16 (bench/results/quant/quant_experts-h200-mxfp4-dot.json). Each
MoE layer keeps its own gate/up and down types (llama.cpp's Q4_K_M gives some layers' ffn_down_exps
Q6_K: ModelConfig's published_layer_formats, one expert layout per layer). Only what one layout cannot hold is
dequantized and re-encoded, in the type holding most expert weights, and said so in the log: a
layer whose gate and up differ, float experts beside block ones. Where most expert weights are
F32/F16/BF16 they all load as float, to be stored as --expert-quant says. Any other expert type is
refused at start-up by name. Every other tensor is dequantized by the gguf package.

GGUF's llama (and so Mixtral) q and k rows are not Hugging Face's: llama.cpp rotates adjacent
pairs of a head's dims where transformers rotates its two halves, and its converter reorders the
rows to match (row 2 i + h of a head <- row h * head_dim / 2 + i). They are put back on reading.

deepseek2's latent attention has tensors of its own (attn_q_a, attn_kv_a_mqa, ...). Files from
llama.cpp's converter since it split kv_b_proj hold each head's W_uk transposed as attn_k_b
[heads, kv_lora_rank, nope] and W_uv as attn_v_b [heads, v, kv_lora_rank]; the two are read
together back into kv_b's rows (per head: nope rows of W_uk, then v rows of W_uv). Older files hold
attn_kv_b as it is.

gpt-oss's converter splits the released experts' alternating gate and up rows (and bias entries)
into ffn_gate_exps and ffn_up_exps (their MXFP4 blocks re-laid, codes and scales kept) and their
biases into ffn_{gate,up,down}_exps.bias; its sinks are attn_sinks, its router's bias ffn_gate_inp.bias.
Its q and k rows are as released (llama.cpp rotates its heads' halves, as transformers does).
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from gguf import quants
from tqdm import tqdm

from moe_serve.engine.experts.formats.base import pack_nibbles
from moe_serve.engine.experts.formats.iq4 import IQ4_NL, IQ4_XS
from moe_serve.engine.experts.formats.k_quants import Q2_K, Q3_K, Q4_K, Q5_K, Q6_K
from moe_serve.engine.experts.formats.legacy_quants import Q4_0, Q4_1, Q5_0, Q5_1
from moe_serve.engine.experts.formats.mxfp4 import Mxfp4
from moe_serve.engine.experts.formats.q8_0 import Q8_0
from moe_serve.engine.gguf.config import Metadata, hf_config, run_layers
from moe_serve.engine.gguf.reader import GgufFile, GgufTensor
from moe_serve.engine.loader import (
    EncodedWeight,
    LoadError,
    Tensors,
    TensorTarget,
    map_names,
)
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.models.family import EXPERT_PREFIX, TensorRule
from moe_serve.engine.models.rope import pairs_to_halves_rows

log = logging.getLogger(__name__)

# GGML type -> the expert format that keeps its blocks as they are (MXFP4's: their codes and scales)
EXPERT_BLOCK_FORMATS = {**{fmt.ggml_type: fmt.name for fmt in (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
                                                             Q6_K, IQ4_NL, IQ4_XS)},
                        "MXFP4": Mxfp4.name}
_MXFP4_BLOCK_BYTES = 17  # GGML's: an E8M0 exponent byte, then 16 bytes of E2M1 codes
_FLOAT_TYPES = ("F32", "F16", "BF16")
_CONFIG_TENSORS = ("rope_freqs.weight",)  # read into the config (config.py), no parameter of their own
_V_B = ".attn_v_b.weight"  # read with its layer's attn_k_b (_kv_b), no target of its own


def _shared_rules() -> list[TensorRule]:
    """Every architecture's: embedding, head, norms, router, MLPs (dense and shared) and experts."""
    rules = [
        TensorRule("token_embd.weight", "embed.weight"),
        TensorRule("output_norm.weight", "norm.weight"),
        TensorRule("output.weight", "lm_head.weight"),
        TensorRule("blk.{L}.attn_norm.weight", "layers.{L}.attn_norm.weight"),
        TensorRule("blk.{L}.ffn_norm.weight", "layers.{L}.mlp_norm.weight"),
        TensorRule("blk.{L}.ffn_gate_inp.weight", "layers.{L}.mlp.router.weight"),
        TensorRule("blk.{L}.ffn_gate_inp.bias", "layers.{L}.mlp.router.bias"),
        TensorRule("blk.{L}.ffn_gate_inp_shexp.weight", "layers.{L}.mlp.shared_gate.weight"),
        TensorRule("blk.{L}.exp_probs_b.bias", "layers.{L}.mlp.router_bias"),
    ]
    for kind in ("weight", "bias"):
        rules.append(TensorRule(f"blk.{{L}}.attn_output.{kind}", f"layers.{{L}}.attn.o.{kind}"))
        for suffix, ours in (("", "mlp."), ("_shexp", "mlp.shared.")):  # dense MLP, a shared expert
            rules += [TensorRule(f"blk.{{L}}.ffn_{p}{suffix}.{kind}", f"layers.{{L}}.{ours}gate_up.{kind}", p)
                      for p in ("gate", "up")]
            rules.append(TensorRule(f"blk.{{L}}.ffn_down{suffix}.{kind}", f"layers.{{L}}.{ours}down.{kind}"))
    rules += [TensorRule(f"blk.{{L}}.ffn_{p}_exps.weight", EXPERT_PREFIX + p) for p in ("gate", "up", "down")]
    rules += [TensorRule(f"blk.{{L}}.ffn_{p}_exps.bias", f"{EXPERT_PREFIX}{p}_bias") for p in ("gate", "up", "down")]
    return rules


def _rules() -> tuple[TensorRule, ...]:
    rules = _shared_rules() + [
        TensorRule("blk.{L}.attn_q_norm.weight", "layers.{L}.attn.q_norm.weight"),
        TensorRule("blk.{L}.attn_k_norm.weight", "layers.{L}.attn.k_norm.weight"),
        TensorRule("blk.{L}.post_attention_norm.weight", "layers.{L}.mlp_norm.weight"),  # glm4moe's ffn_norm
        TensorRule("blk.{L}.attn_sinks.weight", "layers.{L}.attn.sinks"),
    ]
    for kind in ("weight", "bias"):
        rules += [TensorRule(f"blk.{{L}}.attn_{p}.{kind}", f"layers.{{L}}.attn.qkv.{kind}", p) for p in "qkv"]
    return tuple(rules)


def _latent_attention_rules() -> tuple[TensorRule, ...]:
    """deepseek2's: its latent attention and the experts' correction bias."""
    names = {"attn_q": "q", "attn_q_a": "q_a", "attn_q_b": "q_b", "attn_kv_a_mqa": "kv_a", "attn_kv_b": "kv_b",
             "attn_k_b": "kv_b"}
    return tuple(_shared_rules() + [TensorRule(f"blk.{{L}}.{gguf}.{kind}", f"layers.{{L}}.attn.{ours}.{kind}")
                                    for gguf, ours in names.items() for kind in ("weight", "bias")] + [
        TensorRule("blk.{L}.attn_q_a_norm.weight", "layers.{L}.attn.q_a_norm.weight"),
        TensorRule("blk.{L}.attn_kv_a_norm.weight", "layers.{L}.attn.kv_a_norm.weight"),
    ])


GGUF_RULES = _rules()
LATENT_ATTENTION_RULES = _latent_attention_rules()


class GgufCheckpoint:
    """A GGUF file as loader.Checkpoint: its config, names and tensors."""
    quant = None  # GGML types are per tensor: tensors() decodes them itself

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = GgufFile(path)
        meta = Metadata(self.file)
        self.rules = LATENT_ATTENTION_RULES if meta.architecture == "deepseek2" else GGUF_RULES
        run = run_layers(meta)  # the multi-token-prediction layers after them are not loaded
        self._tensors = {name: t for name, t in self.file.tensors.items()
                         if name not in _CONFIG_TENSORS and not name.endswith(_V_B) and _layer(name) < run}
        experts = {name: t for name, t in self._tensors.items() if name.endswith("_exps.weight")}
        counts = _expert_types(list(experts.values()))
        expert_type = counts.most_common(1)[0][0] if counts else None  # the type of most expert weights
        config = ModelConfig.from_hf(hf_config(self.file))
        # (layer, matrix) -> the GGML type its blocks are kept in: the file's, where one layout holds it
        self._kept = _kept_types(experts, expert_type, config.moe_layers)
        self._re_encoded = sorted({t.tensor_type.name for name, t in experts.items()
                                   if self._kept.get(_expert_key(name), expert_type) != t.tensor_type.name})
        self.kept_type = expert_type if expert_type in EXPERT_BLOCK_FORMATS else None
        published = EXPERT_BLOCK_FORMATS.get(expert_type, "none")
        layer_formats = tuple(tuple(EXPERT_BLOCK_FORMATS[self._kept[layer, matrix]] for matrix in ("gate_up", "down"))
                              for layer in config.moe_layers) if self._kept else ()
        if all(pair == (published, published) for pair in layer_formats):
            layer_formats = ()  # one layout for every layer
        self.config = replace(config, published_expert_format=published, published_layer_formats=layer_formats)
        self._pairs_rotated = Metadata(self.file).architecture == "llama"

    def targets(self) -> list[TensorTarget]:
        if self._re_encoded:
            log.warning("expert tensors of %s are re-encoded as %s, the type of most experts (a layer's gate and up "
                        "share one format, and float experts beside block ones take it): not bit for bit",
                        ", ".join(self._re_encoded), self.kept_type or "floats")
        return map_names(list(self._tensors), self.path, self.rules)

    def tensors(self, targets: list[TensorTarget], bar: tqdm) -> Tensors:
        for target in targets:
            tensor = self._tensors[target.hf_name]
            if target.is_expert and self._kept.get(_expert_key(target.hf_name)) == tensor.tensor_type.name:
                rows = torch.from_numpy(np.array(tensor.data))  # [E, N, bytes]
                yield target, _mxfp4_rows(rows) if tensor.tensor_type.name == "MXFP4" else EncodedWeight(rows, None)
            else:
                yield target, self._dequantized(target, tensor)
            bar.update()

    def _dequantized(self, target: TensorTarget, tensor: GgufTensor) -> torch.Tensor:
        try:
            values = quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise LoadError(f"tensor {tensor.name!r} is {tensor.tensor_type.name}, which the gguf package cannot "
                            "dequantize") from None
        weights = torch.from_numpy(values if values.flags.writeable else values.copy()).float()
        if tensor.name.endswith(".attn_k_b.weight"):
            weights = self._kv_b(tensor.name, weights)
        if self._pairs_rotated and target.part in ("q", "k"):
            heads = self.config.num_heads if target.part == "q" else self.config.num_kv_heads
            weights = pairs_to_halves_rows(weights, heads)
        if target.ours.endswith(".shared_gate.weight"):  # [1, H], which llama.cpp's converter squeezes to [H]
            weights = weights.reshape(1, -1)
        return weights


    def _kv_b(self, k_b_name: str, w_uk_t: torch.Tensor) -> torch.Tensor:
        """kv_b's weight [heads * (nope + v), kv_lora_rank] from a layer's attn_k_b [heads, kv_lora_rank, nope]
        and its attn_v_b [heads, v, kv_lora_rank]."""
        v_name = k_b_name.removesuffix(".attn_k_b.weight") + _V_B
        v_b = self.file.tensors.get(v_name)
        if v_b is None:
            raise LoadError(f"missing tensor {v_name!r}, which {k_b_name!r} needs")
        w_uv = torch.from_numpy(np.array(quants.dequantize(v_b.data, v_b.tensor_type), dtype=np.float32))
        heads = self.config.num_heads
        w_uk = w_uk_t.reshape(heads, self.config.mla.kv_lora_rank, -1).transpose(1, 2)  # [heads, nope, C]
        return torch.cat([w_uk, w_uv.reshape(heads, -1, self.config.mla.kv_lora_rank)], dim=1).flatten(0, 1)


def _mxfp4_rows(blocks: torch.Tensor) -> EncodedWeight:
    """GGML's MXFP4 rows [..., N, K / 32 * 17] (per block an E8M0 byte e, then 16 bytes, byte j holding
    code j in its low nibble and code j + 16 in its high one; w = kvalue[code] * 2^(e - 128), kvalue
    being twice E2M1's value) as mxfp4.py's data [..., N, K / 2] (weight 2j in byte j's low nibble) and
    scales [..., N, K / 32]: w = E2M1 * 2^(e - 127), the same weights; only e = 0 (weights below 2^-125)
    reads as 0 there."""
    per_block = blocks.unflatten(-1, (-1, _MXFP4_BLOCK_BYTES))  # [..., N, K / 32, 17]
    codes = per_block[..., 1:]
    in_order = torch.cat([codes & 15, codes >> 4], dim=-1).flatten(-2)  # [..., N, K]
    return EncodedWeight(pack_nibbles(in_order), per_block[..., 0].contiguous())


def _expert_types(experts: list[GgufTensor]) -> Counter[str]:
    """Expert weights by GGML type; ValueError naming a type no expert format keeps and that does
    not load as float."""
    counts: Counter[str] = Counter()
    for tensor in experts:
        name = tensor.tensor_type.name
        if name not in EXPERT_BLOCK_FORMATS and name not in _FLOAT_TYPES:
            raise ValueError(f"{name} experts are not supported (tensor {tensor.name}); supported: "
                             f"{', '.join([*EXPERT_BLOCK_FORMATS, *_FLOAT_TYPES])}")
        counts[name] += tensor.n_elements
    return counts


def _layer(name: str) -> int:
    """The decoder layer of a tensor named blk.L...., -1 for those of no layer (embedding, head)."""
    return int(name.split(".")[1]) if name.startswith("blk.") else -1


def _expert_key(name: str) -> tuple[int, str]:
    """'blk.3.ffn_up_exps.weight' -> (3, 'gate_up'): the layer and the matrix of our layout it fills."""
    _, layer, part = name.split(".")[:3]
    return int(layer), "down" if part == "ffn_down_exps" else "gate_up"


def _kept_types(experts: dict[str, GgufTensor], main: str | None, moe_layers: tuple[int, ...]) -> dict[tuple[int, str], str]:
    """(layer, matrix) -> the GGML type whose blocks the store keeps; empty where the experts load as
    float (most expert weights are). A matrix keeps its own block type; gate and up of different
    types, or float experts, take the main type."""
    if main not in EXPERT_BLOCK_FORMATS:
        return {}
    types: dict[tuple[int, str], set[str]] = {}
    for name, tensor in experts.items():
        types.setdefault(_expert_key(name), set()).add(tensor.tensor_type.name)
    kept = {}
    for layer in moe_layers:
        for matrix in ("gate_up", "down"):
            found = types.get((layer, matrix), set())
            kept[layer, matrix] = found.pop() if len(found) == 1 and found <= set(EXPERT_BLOCK_FORMATS) else main
    return kept
