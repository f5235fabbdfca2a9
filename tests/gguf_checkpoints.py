"""Tiny GGUF files for tests/engine/gguf/: a tiny model of a family written as llama.cpp's converter
writes it (its metadata keys, tensor names, experts stacked [E, N, K], gpt-oss's gate and up split
apart, llama's q/k rows reordered, llama3 rope as rope_freqs), in chosen GGML types, next to the
Hugging Face checkpoint of the same weights as the gguf package dequantizes them. Written here from
the published format.

    gguf_file, reference = gguf_pair("qwen3_moe", tmp_path, expert_type="Q4_K", hidden_size=256, ...)

Loading `gguf_file` must compute what loading `reference` computes.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType, quants
from safetensors.torch import save_file

from moe_serve.engine.experts.formats import expert_format
from tests.tiny_checkpoints import tiny_hf_model

ARCHITECTURES = {"llama": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen2_moe": "qwen2moe",
                 "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2",
                 "glm4_moe": "glm4moe", "ernie4_5_moe": "ernie4_5-moe", "minimax_m2": "minimax-m2",
                 "dots1": "dots1", "gpt_oss": "gpt-oss"}
_LAYER = r"model\.layers\.(\d+)\."
_NAMES = [  # Hugging Face (transformers 5, in memory) -> GGUF
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"model\.norm\.weight", "output_norm.weight"),
    (r"lm_head\.weight", "output.weight"),
    (_LAYER + r"input_layernorm\.weight", r"blk.\1.attn_norm.weight"),
    (_LAYER + r"post_attention_layernorm\.weight", r"blk.\1.ffn_norm.weight"),
    (_LAYER + r"self_attn\.([qkv])_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
    (_LAYER + r"self_attn\.o_proj\.(weight|bias)", r"blk.\1.attn_output.\2"),
    (_LAYER + r"self_attn\.([qk])_norm\.weight", r"blk.\1.attn_\2_norm.weight"),
    (_LAYER + r"mlp\.(gate|up|down)_proj\.(weight|bias)", r"blk.\1.ffn_\2.\3"),
    (_LAYER + r"mlp\.shared_expert\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_shexp.weight"),
    (_LAYER + r"mlp\.shared_expert_gate\.weight", r"blk.\1.ffn_gate_inp_shexp.weight"),
    (_LAYER + r"mlp\.gate\.weight", r"blk.\1.ffn_gate_inp.weight"),
    # deepseek2: latent attention, shared experts, the routers' correction bias
    (_LAYER + r"self_attn\.(q_a|q_b|kv_b)_proj\.(weight|bias)", r"blk.\1.attn_\2.\3"),
    (_LAYER + r"self_attn\.kv_a_proj_with_mqa\.(weight|bias)", r"blk.\1.attn_kv_a_mqa.\2"),
    (_LAYER + r"self_attn\.(q_a|kv_a)_layernorm\.weight", r"blk.\1.attn_\2_norm.weight"),
    (_LAYER + r"mlp\.shared_experts\.(gate|up|down)_proj\.weight", r"blk.\1.ffn_\2_shexp.weight"),
    (_LAYER + r"mlp\.(gate\.|gate\.moe_statics\.)?e_score_correction_bias", r"blk.\1.exp_probs_b.bias"),
    # gpt-oss: attention sinks (the converter names them .weight), a router with a bias
    (_LAYER + r"self_attn\.sinks", r"blk.\1.attn_sinks.weight"),
    (_LAYER + r"mlp\.router\.(weight|bias)", r"blk.\1.ffn_gate_inp.\2"),
]


def gguf_name(name: str, arch: str) -> str:
    for pattern, replacement in _NAMES:
        if re.fullmatch(pattern, name):
            renamed = re.sub(pattern, replacement, name)
            if arch in ("glm4moe", "gpt-oss"):  # their post-attention norm keeps that name
                renamed = renamed.replace(".ffn_norm.", ".post_attention_norm.")
            return renamed
    raise KeyError(name)


def llama_cpp_row_order(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The converter's reorder of llama q/k rows: each head's halves (i, D/2 + i) interleaved as rows
    2 i, 2 i + 1, so llama.cpp's rotation of adjacent pairs computes transformers' rotate-half."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def encoded(w: torch.Tensor, type_name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """w [..., K] in a GGML type: the gguf package's quantizer where it has one, else (the k-quants)
    our expert format's encoding."""
    qtype = GGMLQuantizationType[type_name]
    values = w.float().numpy()
    if type_name == "F32":
        return values, qtype
    if type_name == "F16":
        return values.astype(np.float16), qtype
    try:
        return quants.quantize(values, qtype), qtype
    except NotImplementedError:
        return expert_format(type_name.lower(), torch.float32).encode(w)[0].numpy(), qtype


def dequantized(data: np.ndarray, qtype: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(np.array(quants.dequantize(data, qtype), dtype=np.float32))


def gguf_pair(family: str, dst: Path, *, expert_type: str = "F32", weight_type: str = "F32",
              types: dict[str, str] | None = None, tokenizer: dict[str, Any] | None = None,
              split_kv_b: bool = True, **sizes: Any) -> tuple[Path, Path]:
    """Write dst/model.gguf and dst/reference/ from tiny_hf_model(family, **sizes); return both.
    Routed experts are written in expert_type, other matrices in weight_type where their rows are whole
    blocks of it (F32 otherwise, as are norms and biases); `types` sets single GGUF tensors' types.
    `tokenizer`: tokenizer.ggml.* metadata to add. `split_kv_b`: deepseek2's kv_b as llama.cpp's
    converter writes it now (attn_k_b, attn_v_b), else as it did before (attn_kv_b)."""
    model = tiny_hf_model(family, **sizes)
    config, arch = model.config, ARCHITECTURES[family]
    dst.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(str(dst / "model.gguf"), arch)
    _metadata(writer, config, arch)
    if arch == "deepseek2":
        _deepseek2_metadata(writer, config, split_kv_b)
    for key, value in (tokenizer or {}).items():
        getattr(writer, f"add_{key}")(value)
    reference: dict[str, torch.Tensor] = {}
    in_file: dict[str, tuple[np.ndarray, GGMLQuantizationType]] = {}  # GGUF name -> what was written

    def add(name: str, w: torch.Tensor, type_name: str) -> torch.Tensor:
        """Write w in its type; return the weights the file holds, as the gguf package dequantizes them."""
        data, qtype = in_file[name] = encoded(w, (types or {}).get(name, type_name))
        writer.add_tensor(name, data, raw_dtype=qtype)
        return dequantized(data, qtype).reshape(w.shape)

    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        layer = re.match(_LAYER, name)
        if arch == "gpt-oss" and ".experts." in name:
            reference[name] = _gpt_oss_experts(add, layer[1], name, w, expert_type)
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows first
            gate, up = w.chunk(2, dim=1)
            reference[name] = torch.cat([add(f"blk.{layer[1]}.ffn_{part}_exps.weight", half, expert_type)
                                         for part, half in (("gate", gate), ("up", up))], dim=1)
        elif name.endswith("experts.down_proj"):
            reference[name] = add(f"blk.{layer[1]}.ffn_down_exps.weight", w, expert_type)
        elif name.endswith("kv_b_proj.weight") and split_kv_b:  # per head: W_uk transposed, W_uv
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            w_uk, w_uv = w.reshape(heads, -1, w.shape[1]).split([nope, config.v_head_dim], dim=1)
            add(f"blk.{layer[1]}.attn_k_b.weight", w_uk.transpose(1, 2).contiguous(), "F32")
            add(f"blk.{layer[1]}.attn_v_b.weight", w_uv.contiguous(), "F32")
            reference[name] = w
        else:
            target = gguf_name(name, arch)
            block = GGML_QUANT_SIZES[GGMLQuantizationType[weight_type]][0]
            type_name = weight_type if w.dim() == 2 and w.shape[1] % block == 0 else "F32"
            # the converter squeezes these: [1, H] and ERNIE's [1, E]
            written = w.squeeze(0) if target.endswith(("ffn_gate_inp_shexp.weight", "exp_probs_b.bias")) else w
            if arch == "llama" and re.search(r"attn_[qk]\.", target):
                written = llama_cpp_row_order(w, config.num_attention_heads if ".attn_q." in target
                                              else config.num_key_value_heads)
            add(target, written, type_name)
            # rows are quantized apart, so the reference is the same rows in Hugging Face's order
            reference[name] = dequantized(*encoded(w, (types or {}).get(target, type_name))).reshape(w.shape)
    if arch == "glm4moe":
        _add_nextn_layers(writer, in_file, config)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst / "model.gguf", _save_reference(model, reference, dst / "reference")


def _gpt_oss_experts(add: Callable[[str, torch.Tensor, str], torch.Tensor], layer: str, name: str, w: torch.Tensor,
                     expert_type: str) -> torch.Tensor:
    """gpt-oss's experts as llama.cpp's converter writes them: transformers' gate_up [E, H, 2I] and down
    [E, I, H] (inputs by outputs) as rows, gate and up (rows, or bias entries, alternating in
    transformers') split into tensors of their own, biases in F32. Returns what the file holds, in
    transformers' shape and order."""
    kind = "bias" if name.endswith("_bias") else "weight"
    rows = w if kind == "bias" else w.transpose(-1, -2)  # [E, 2I or H, ...]
    type_name = "F32" if kind == "bias" else expert_type
    if "gate_up_proj" in name:
        halves = [add(f"blk.{layer}.ffn_{part}_exps.{kind}", rows[:, first::2].contiguous(), type_name)
                  for first, part in enumerate(("gate", "up"))]
        held = torch.stack(halves, dim=2).flatten(1, 2)  # alternating again
    else:
        held = add(f"blk.{layer}.ffn_down_exps.{kind}", rows.contiguous(), type_name)
    return held if kind == "bias" else held.transpose(-1, -2)


def _add_nextn_layers(writer: GGUFWriter, in_file: dict[str, tuple[np.ndarray, GGMLQuantizationType]],
                      config: Any) -> None:
    """GLM-4.5's multi-token-prediction layers as llama.cpp writes them, counted in block_count after
    the decoder layers: a decoder layer's tensors (the last one's, again) and the nextn.* ones."""
    gen = torch.Generator().manual_seed(7)
    last = f"blk.{config.num_hidden_layers - 1}."
    for i in range(config.num_nextn_predict_layers):
        layer = config.num_hidden_layers + i
        for name, (data, qtype) in list(in_file.items()):
            if name.startswith(last):
                writer.add_tensor(f"blk.{layer}." + name.removeprefix(last), data, raw_dtype=qtype)
        hidden = config.hidden_size
        for name, shape in (("eh_proj", (hidden, 2 * hidden)), ("enorm", (hidden,)), ("hnorm", (hidden,)),
                            ("shared_head_norm", (hidden,))):
            writer.add_tensor(f"blk.{layer}.nextn.{name}.weight", torch.randn(shape, generator=gen).numpy())


def _metadata(writer: GGUFWriter, config: Any, arch: str) -> None:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers + (config.num_nextn_predict_layers if arch == "glm4moe" else 0))
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    if arch != "deepseek2":  # its own (_deepseek2_metadata)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)))
    if arch in ("glm4moe", "dots1"):
        _glm4moe_metadata(writer, config)
    if arch == "ernie4_5-moe":
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        writer.add_expert_shared_count(config.moe_num_shared_experts)
        writer.add_leading_dense_block_count(config.moe_layer_start_index)
        writer.add_interleave_moe_layer_step(config.moe_layer_interval)
    if arch == "minimax-m2":
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if arch == "gpt-oss":
        writer.add_expert_feed_forward_length(config.intermediate_size)
        writer.add_sliding_window(config.sliding_window)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif rope["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _llama3_divisors(rope, head_dim))
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch in ("qwen2moe", "qwen3moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch == "olmoe" and config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)


def _deepseek2_metadata(writer: GGUFWriter, config: Any, split_kv_b: bool) -> None:
    """The keys llama.cpp's converter writes for DeepSeek-V2/V3 beyond _metadata's (whose head
    sizes it overrides: a latent attention's key is the latent and the roped part, its value the
    latent, once kv_b is split)."""
    rope_dim, rank = config.qk_rope_head_dim, config.kv_lora_rank
    writer.add_head_count_kv(1)
    writer.add_rope_dimension_count(rope_dim)
    if split_kv_b:
        writer.add_key_length(rank + rope_dim)
        writer.add_value_length(rank)
        writer.add_key_length_mla(config.qk_nope_head_dim + rope_dim)
        writer.add_value_length_mla(config.v_head_dim)
    else:
        writer.add_key_length(config.qk_nope_head_dim + rope_dim)
        writer.add_value_length(config.v_head_dim)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(rank)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    v3 = type(config).__name__ == "DeepseekV3Config"
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if v3 else ExpertGatingFuncType.SOFTMAX)
    if (config.n_group or 1) > 1:
        writer.add_expert_group_count(config.n_group)
        writer.add_expert_group_used_count(config.topk_group)
    rope = config.rope_parameters
    if rope["rope_type"] == "yarn" and rope.get("mscale_all_dim"):
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _glm4moe_metadata(writer: GGUFWriter, config: Any) -> None:
    """The keys llama.cpp's converter writes for GLM-4.5 and dots.llm1 beyond _metadata's (no expert
    groups: their checkpoints have one)."""
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_weights_norm(config.norm_topk_prob)
    if getattr(config, "num_nextn_predict_layers", 0):
        writer.add_nextn_predict_layers(config.num_nextn_predict_layers)


def _llama3_divisors(rope: dict[str, Any], head_dim: int) -> np.ndarray:
    """llama.cpp's rope_freqs for llama3 scaling: what each frequency is divided by."""
    length, low, high = rope["original_max_position_embeddings"], rope["low_freq_factor"], rope["high_freq_factor"]
    divisors = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < length / high:
            divisors.append(1.0)
        elif wavelength > length / low:
            divisors.append(rope["factor"])
        else:
            blend = (length / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - blend) / rope["factor"] + blend))
    return np.array(divisors, dtype=np.float32)


def _save_reference(model: torch.nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> Path:
    path.mkdir()
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})
    return path
