"""The model's shape, read once from the checkpoint's config.json and frozen."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_serve.engine.experts.activation import ExpertActivation
from moe_serve.engine.experts.formats import expert_format
from moe_serve.engine.experts.formats.mixes import MIXES, mix_formats
from moe_serve.engine.experts.layout import ExpertLayout
from moe_serve.engine.experts.routing import Router
from moe_serve.engine.models.registry import family_for
from moe_serve.engine.quantized_checkpoints import checkpoint_quant
from moe_serve.engine.models.rope import RopeConfig
from moe_serve.engine.models.variants import LatentAttention

QK_NORM_KINDS = ("none", "per_head", "full")


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    intermediate_size: int = 0  # dense MLP width; 0 when every layer is MoE
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: str = "none"  # none | per_head (RMSNorm over head_dim) | full (over the whole q / k projection)
    clip_qkv: float | None = None
    # q and k rotate adjacent pairs of dims (ERNIE): the loader reorders their rows to halves
    # (rope.pairs_to_halves_rows), which the attention rotates as every other family's
    rope_interleaved: bool = False
    mla: LatentAttention | None = None  # DeepSeek's latent attention: head_dim is then the cache row's
    attention_scale: float | None = None  # softmax scale of q.k; None: head_dim ** -0.5
    attention_sinks: bool = False  # a learned logit per query head in each softmax, with no value (gpt-oss)
    attention_windows: tuple[int | None, ...] = ()  # per layer: sliding window, None = full causal
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # MoE (all zero / empty for dense models)
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    shared_expert_intermediate_size: int = 0
    shared_expert_gated: bool = True  # Qwen2-MoE scales it by sigmoid(shared_gate(x)); DeepSeek adds it as is
    router: Router = Router()
    router_logit_bias: bool = False  # the router's linear has a bias (gpt-oss)
    expert_activation: ExpertActivation = ExpertActivation()
    expert_biases: bool = False  # each routed expert's gate/up and down have biases (gpt-oss)
    moe_layers: tuple[int, ...] = ()  # decoder layer indices that are MoE, in order
    # the experts/formats/ name of the routed experts as a quantized checkpoint publishes them
    # (moe_serve/engine/quantized_checkpoints/); "none" for a float checkpoint
    published_expert_format: str = "none"
    # per MoE layer, (gate/up's, down's) format names, where layers differ (a GGUF Q4_K_M file keeps
    # some layers' ffn_down in Q6_K); empty: every layer's experts are published_expert_format
    published_layer_formats: tuple[tuple[str, str], ...] = ()
    # decoder layers the checkpoint carries past num_layers that are not run: DeepSeek-V3's
    # multi-token-prediction layers (num_nextn_predict_layers), which the loader skips unread
    unrun_layers: int = 0

    def __post_init__(self) -> None:
        if self.qk_norm not in QK_NORM_KINDS:
            raise ValueError(f"qk_norm {self.qk_norm!r} not in {QK_NORM_KINDS}")
        if len(self.attention_windows) != self.num_layers:
            raise ValueError(f"attention_windows has {len(self.attention_windows)} entries for {self.num_layers} layers")
        if self.moe_layers and not (0 < self.top_k <= self.num_experts):
            raise ValueError(f"top_k={self.top_k} must be in 1..num_experts={self.num_experts}")
        if self.published_layer_formats and len(self.published_layer_formats) != len(self.moe_layers):
            raise ValueError(f"published_layer_formats has {len(self.published_layer_formats)} entries for "
                             f"{len(self.moe_layers)} MoE layers")
        if len(self.moe_layers) < self.num_layers and self.intermediate_size <= 0:
            raise ValueError("dense layers present but intermediate_size is 0")
        if self.rope_interleaved and (self.qk_norm != "none" or self.mla is not None):
            raise ValueError("interleaved rope with q/k norm or latent attention: their rows are not reordered")
        if self.moe_layers and self.num_experts % self.router.groups:
            raise ValueError(f"{self.num_experts} experts do not split into n_group={self.router.groups} groups")

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a config.json dict; raises ValueError for unsupported architectures or options."""
        family = family_for(hf)
        num_layers = hf["num_hidden_layers"]
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        common: dict[str, Any] = dict(
            architecture=next(a for a in hf["architectures"] if a in family.architectures),
            family=family.name,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(hf),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_windows=(None,) * num_layers,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )
        quant = checkpoint_quant(hf)
        if quant is not None:
            common["published_expert_format"] = quant.expert_format
        return cls(**{**common, **family.config_fields(hf)})

    @property
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    @property
    def rope_dim(self) -> int:
        """The dims of a head that RoPE rotates: a latent attention's roped part, else the head's
        first partial_rotary_factor of them."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return int(self.head_dim * self.rope.partial_rotary_factor)

    @property
    def values_are_keys(self) -> bool:
        """A latent attention attends over its cached latent as keys and values alike: the KV cache
        holds it once."""
        return self.mla is not None

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)

    def moe_index(self, layer: int) -> int | None:
        """Index among the MoE layers (LayerRouting.layer, ExpertStore's first axis); None if dense."""
        return self.moe_layers.index(layer) if layer in self.moe_layers else None

    def expert_layout(self, dtype: torch.dtype, quant: str = "none") -> ExpertLayout:
        """One routed expert's row: computed in dtype, stored in the --expert-quant format `quant`, or
        as a quantized checkpoint publishes its experts (which are never quantized again)."""
        published = self.published_expert_format
        if published != "none" and quant not in ("none", published):
            raise ValueError(f"the checkpoint's experts are {published}: --expert-quant {quant} would quantize them "
                             f"again; leave it unset")
        return self._layout(dtype, quant if published == "none" else published)

    def expert_layouts(self, dtype: torch.dtype, quant: str = "none") -> list[ExpertLayout]:
        """Each MoE layer's expert layout: expert_layout's, or each layer's own where the checkpoint
        publishes layers in different formats or `quant` is a mix of formats (formats/mixes.py)."""
        if quant in MIXES:
            if self.published_expert_format != "none":
                self.expert_layout(dtype, quant)  # refused: the checkpoint's experts are quantized already
            layer_formats = [mix_formats(quant, layer, self.num_layers) for layer in self.moe_layers]
        elif self.published_layer_formats:
            self.expert_layout(dtype, quant)  # the same refusal of --expert-quant
            layer_formats = list(self.published_layer_formats)
        else:
            return [self.expert_layout(dtype, quant)] * self.num_moe_layers
        return [self._layout(dtype, gate_up, down) for gate_up, down in layer_formats]

    def _layout(self, dtype: torch.dtype, gate_up: str, down: str | None = None) -> ExpertLayout:
        """An expert row of this model's shape, activation and biases, its matrices in the formats named
        (down None: gate_up's)."""
        return ExpertLayout(self.hidden_size, self.moe_intermediate_size, dtype, expert_format(gate_up, dtype),
                            None if down is None else expert_format(down, dtype),
                            activation=self.expert_activation, biases=self.expert_biases)
