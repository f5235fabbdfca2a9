"""A GGUF file's metadata as the config.json ModelConfig.from_hf reads, so a GGUF model is built by
the same family rules as its Hugging Face checkpoint.

llama.cpp keeps a few settings only in the tensors, and they are read from there: tied embeddings
(no output.weight), attention and MLP biases, the dense layers of a Qwen-MoE (no ffn_gate_inp),
and llama3 rope scaling (rope_freqs, one divisor per frequency, from which the llama3 parameters
are recovered and checked to give the same frequencies). Mixtral is GGUF's llama with experts.

ernie4_5-moe's q and k rows come as its config.json's (pairs rotated, reordered by the loader), and
minimax-m2 rotates the first rope.dimension_count dims of a head in halves, as glm4moe below.

deepseek2 holds DeepSeek-V2 and -V3 (and V2-Lite, Moonlight): V3 where its gating function is
sigmoid. Its latent attention's sizes come from the attention.*_lora_rank keys and the head widths
from key_length_mla / value_length_mla (files converted before llama.cpp split kv_b keep them in
key_length / value_length); yarn's mscale and mscale_all_dim from rope.scaling.yarn_log_multiplier
(the converter writes 0.1 x mscale_all_dim, and every published DeepSeek config has mscale equal to it).

glm4moe (GLM-4.5, GLM-4.5-Air) counts its multi-token-prediction layers (nextn_predict_layers, the
last ones) in block_count: they are not run, so the model has block_count - nextn_predict_layers
layers and the checkpoint skips their tensors. It rotates the first rope.dimension_count dims of a
head in halves, as transformers does, so its partial rotation reads as it is.

gpt-oss's expert width is expert_feed_forward_length, its window attention.sliding_window, on every
other layer from the first (llama.cpp hard-codes that pattern for gpt-oss, as transformers' layer_types
default); its gating a softmax over the top-k logits, its SwiGLU's clamp llama.cpp's and transformers'
defaults (no keys). Its yarn is not truncated, as its config.json says: OpenAI's reference keeps the
correction range's bounds fractional, where ggml's yarn rounds them, which a GGUF cannot say.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from moe_serve.engine.gguf.reader import GgufFile, GgufTensor
from moe_serve.engine.models.rope import RopeConfig, rope_frequencies

_DENSE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MOE = {"llama": "MixtralForCausalLM", "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM",
        "olmoe": "OlmoeForCausalLM", "deepseek2": "DeepseekV2ForCausalLM", "glm4moe": "Glm4MoeForCausalLM",
        "ernie4_5-moe": "Ernie4_5_MoeForCausalLM", "minimax-m2": "MiniMaxM2ForCausalLM", "dots1": "Dots1ForCausalLM",
        "gpt-oss": "GptOssForCausalLM"}
ARCHITECTURES = tuple(sorted(set(_DENSE) | set(_MOE)))
# whether llama.cpp renormalises the top-k routing weights of an architecture, when the file has no
# expert_weights_norm key (it does for Mixtral and Qwen3-MoE, as their HF configs do)
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "deepseek2": False, "glm4moe": True,
              "ernie4_5-moe": True, "minimax-m2": True, "dots1": False, "gpt-oss": True}
# architectures whose partial rotation turns a head's first dims in halves, as transformers does
_PARTIAL_ROTATION = ("glm4moe", "minimax-m2")
_SIGMOID_GATING = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid
_REQUIRED = object()


class Metadata:
    """A GGUF's key-value metadata; `arch(key)` reads `<general.architecture>.key`."""

    def __init__(self, file: GgufFile) -> None:
        self.values = file.metadata
        self.architecture = self.get("general.architecture")

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        if key not in self.values and default is _REQUIRED:
            raise ValueError(f"GGUF metadata has no {key}")
        return self.values.get(key, default)

    def arch(self, key: str, default: Any = _REQUIRED) -> Any:
        return self.get(f"{self.architecture}.{key}", default)


def hf_config(file: GgufFile) -> dict[str, Any]:
    """The config.json dict of the model in a GGUF file; ValueError naming what is not supported."""
    meta = Metadata(file)
    arch, tensors = meta.architecture, file.tensors
    experts = int(meta.arch("expert_count", 0))
    table = _MOE if experts else _DENSE
    if arch not in table:
        kind = "MoE" if experts else "dense"
        raise ValueError(f"GGUF architecture {arch!r} ({kind}) is not supported; supported: dense "
                         f"{', '.join(_DENSE)}, MoE {', '.join(_MOE)} (Mixtral is llama with experts)")
    hidden, heads = meta.arch("embedding_length"), meta.arch("attention.head_count")
    kv_heads = meta.arch("attention.head_count_kv", heads)
    if isinstance(heads, list) or isinstance(kv_heads, list):
        raise ValueError("GGUF files with per-layer head counts are not supported")
    head_dim = meta.arch("attention.key_length", hidden // heads)
    hf: dict[str, Any] = dict(
        architectures=[table[arch]],
        vocab_size=meta.arch("vocab_size", None) or _rows(tensors["token_embd.weight"]),
        hidden_size=hidden,
        num_hidden_layers=run_layers(meta),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=meta.arch("attention.layer_norm_rms_epsilon"),
        max_position_embeddings=meta.arch("context_length"),
        rope_parameters=_rope(meta, tensors.get("rope_freqs.weight"), _roped_dims(meta, head_dim)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id", None),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id", None),
        intermediate_size=meta.arch("feed_forward_length", 0),
        attention_bias="blk.0.attn_q.bias" in tensors,
        mlp_bias="blk.0.ffn_up.bias" in tensors,
    )
    if experts:
        hf.update(_moe_fields(meta, tensors, experts))
    if arch == "deepseek2":
        hf.update(_deepseek2_fields(meta, tensors))
    if arch == "glm4moe":
        hf.update(_glm4moe_fields(meta, tensors))
    if arch == "dots1":
        hf.update(_deepseek_moe_fields(meta))
    if arch == "ernie4_5-moe":
        hf.update(_ernie4_5_moe_fields(meta, hf["mlp_only_layers"]))
    if arch == "gpt-oss":
        hf.update(_gpt_oss_fields(meta, hf["rope_parameters"]))
    return hf


def _gpt_oss_fields(meta: Metadata, rope: dict[str, Any]) -> dict[str, Any]:
    layers = run_layers(meta)
    return dict(sliding_window=meta.arch("attention.sliding_window"),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
                rope_parameters={**rope, "truncate": False} if rope["rope_type"] == "yarn" else rope)


def _ernie4_5_moe_fields(meta: Metadata, dense: list[int]) -> dict[str, Any]:
    """ERNIE's MoE layers as its config.json counts them: from the first layer with a router, every
    interleave_moe_layer_step-th, to the last (those with ffn_gate_inp, _moe_fields found)."""
    moe = [i for i in range(run_layers(meta)) if i not in dense]
    return dict(moe_num_experts=meta.arch("expert_count"), moe_k=meta.arch("expert_used_count"),
                moe_num_shared_experts=meta.arch("expert_shared_count", 0),
                moe_intermediate_size=meta.arch("expert_feed_forward_length"), moe_layer_start_index=moe[0],
                moe_layer_end_index=moe[-1], moe_layer_interval=meta.arch("interleave_moe_layer_step", 1))


def run_layers(meta: Metadata) -> int:
    """The decoder layers run: block_count, less the multi-token-prediction layers counted in it."""
    return meta.arch("block_count") - meta.arch("nextn_predict_layers", 0)


def _deepseek_moe_fields(meta: Metadata) -> dict[str, Any]:
    """The MoE keys deepseek2, glm4moe and dots1 share: routed and shared experts, leading dense
    blocks, the weights' scale, expert groups."""
    return dict(
        n_routed_experts=meta.arch("expert_count"),
        n_shared_experts=meta.arch("expert_shared_count", 0),
        first_k_dense_replace=meta.arch("leading_dense_block_count", 0),
        routed_scaling_factor=meta.arch("expert_weights_scale", 1.0),
        n_group=meta.arch("expert_group_count", 1),
        topk_group=meta.arch("expert_group_used_count", 1),
    )


def _glm4moe_fields(meta: Metadata, tensors: dict[str, GgufTensor]) -> dict[str, Any]:
    return dict(**_deepseek_moe_fields(meta), use_qk_norm="blk.0.attn_q_norm.weight" in tensors)


def _roped_dims(meta: Metadata, head_dim: int) -> int:
    """The dims RoPE is computed over: a head's, or a latent attention's roped part (a head of its own)."""
    return meta.arch("rope.dimension_count") if meta.architecture == "deepseek2" else head_dim


def _deepseek2_fields(meta: Metadata, tensors: dict[str, GgufTensor]) -> dict[str, Any]:
    rope_dim = meta.arch("rope.dimension_count")
    split = meta.arch("attention.key_length_mla", None) is not None  # kv_b split into k_b and v_b
    key, value = ("attention.key_length_mla", "attention.value_length_mla") if split else ("attention.key_length",
                                                                                         "attention.value_length")
    v3 = meta.arch("expert_gating_func", 1) == _SIGMOID_GATING
    moe = _deepseek_moe_fields(meta)
    fields = dict(
        **moe,
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        q_lora_rank=meta.arch("attention.q_lora_rank", None),
        kv_lora_rank=meta.arch("attention.kv_lora_rank"),
        qk_nope_head_dim=meta.arch(key) - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=meta.arch(value),
        topk_method="noaux_tc" if v3 else ("group_limited_greedy" if moe["n_group"] > 1 else "greedy"),
        scoring_func="sigmoid" if v3 else "softmax",
        attention_bias="blk.0.attn_kv_a_mqa.bias" in tensors,
    )
    if v3:
        fields["rope_interleave"] = True  # llama.cpp rotates deepseek2's adjacent pairs, as transformers does
    return fields


def _moe_fields(meta: Metadata, tensors: dict[str, GgufTensor], experts: int) -> dict[str, Any]:
    layers = range(run_layers(meta))
    moe_layers = [i for i in layers if f"blk.{i}.ffn_gate_inp.weight" in tensors]
    if not moe_layers:
        raise ValueError(f"GGUF metadata says {experts} experts, but no layer has an ffn_gate_inp tensor")
    width = meta.arch("expert_feed_forward_length", None) or _rows(tensors[f"blk.{moe_layers[0]}.ffn_gate_exps.weight"])
    fields = dict(
        num_experts=experts,
        num_experts_per_tok=meta.arch("expert_used_count"),
        norm_topk_prob=bool(meta.arch("expert_weights_norm", _NORM_TOPK[meta.architecture])),
        moe_intermediate_size=width,
        mlp_only_layers=[i for i in layers if i not in moe_layers],
        decoder_sparse_step=1,
        clip_qkv=meta.arch("attention.clamp_kqv", None),
    )
    # their HF configs call the expert width intermediate_size
    if meta.architecture in ("llama", "olmoe", "minimax-m2", "gpt-oss"):
        fields["intermediate_size"] = width
    if meta.architecture == "qwen2moe":
        fields["shared_expert_intermediate_size"] = meta.arch("expert_shared_feed_forward_length")
    return fields


def _rows(tensor: GgufTensor) -> int:
    """Rows of a GGUF matrix (its shape is in ggml's order: columns first)."""
    return int(tensor.shape[1])


def _rope(meta: Metadata, freq_divisors: GgufTensor | None, head_dim: int) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": float(meta.arch("rope.freq_base", 10000.0))}
    rotated = meta.arch("rope.dimension_count", head_dim)
    if rotated != head_dim and meta.architecture in _PARTIAL_ROTATION:
        params["partial_rotary_factor"] = rotated / head_dim
    elif rotated != head_dim:  # llama.cpp's row order of a partly rotated head is not read here
        raise ValueError(f"GGUF rope.dimension_count {rotated} < the head's {head_dim} (a partial rotation) is "
                         "not supported")
    scaling = meta.arch("rope.scaling.type", "none")
    if freq_divisors is not None:
        return {**params, **_llama3_rope(np.asarray(freq_divisors.data, dtype=np.float64), params["rope_theta"],
                                         head_dim)}
    if scaling == "none":
        return {**params, "rope_type": "default"}
    if scaling == "linear":
        return {**params, "rope_type": "linear", "factor": meta.arch("rope.scaling.factor")}
    if scaling == "yarn":
        params.update(rope_type="yarn", factor=meta.arch("rope.scaling.factor"),
                      original_max_position_embeddings=meta.arch("rope.scaling.original_context_length"),
                      beta_fast=meta.arch("rope.scaling.yarn_beta_fast", None),
                      beta_slow=meta.arch("rope.scaling.yarn_beta_slow", None))
        log_multiplier = meta.arch("rope.scaling.yarn_log_multiplier", None)
        if log_multiplier:  # 0.1 x mscale_all_dim, as a float32: 6 digits are all it holds
            params["mscale"] = params["mscale_all_dim"] = round(log_multiplier / 0.1, 6)
        return params
    raise ValueError(f"GGUF rope scaling {scaling!r} is not supported; supported: none, linear, yarn, and llama3 "
                     "(rope_freqs)")


def _llama3_rope(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """llama3 rope parameters from llama.cpp's rope_freqs: frequencies with wavelength under
    L / high_freq_factor are kept (divisor 1), those over L / low_freq_factor divided by `factor`,
    and between the two 1 / divisor = (1 - s) / factor + s with s = (L / wavelength - low) / (high - low).
    Only L / low and L / high are determined, so low = 1; it takes two frequencies in the band."""
    wavelength = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)  # [D/2]
    factor = float(divisors.max())
    band = (divisors > 1 + 1e-6) & (divisors < factor * (1 - 1e-6))
    if band.sum() < 2:
        raise ValueError(f"rope_freqs has {band.sum()} frequencies between its kept and its scaled ones: too few "
                         "to recover llama3 rope scaling from")
    blend = (1 / divisors[band] - 1 / factor) / (1 - 1 / factor)  # s
    slope, intercept = np.polyfit(1 / wavelength[band], blend, 1)  # s = L / (high - 1) / wavelength - 1 / (high - 1)
    high = 1 - 1 / intercept
    params = {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": float(high),
              "original_max_position_embeddings": round(slope * (high - 1))}
    recovered = rope_frequencies(RopeConfig.from_hf({"rope_parameters": {**params, "rope_theta": theta}}), head_dim)[0]
    stored = 1 / torch.from_numpy(wavelength / (2 * math.pi) * divisors).float()
    if not torch.allclose(recovered, stored, rtol=1e-4, atol=0):
        raise ValueError("rope_freqs is not a llama3 rope scaling: only those are supported")
    return params
