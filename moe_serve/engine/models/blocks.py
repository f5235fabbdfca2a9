"""Shared blocks of every family: RMSNorm, GQA attention over the KV cache, SwiGLU MLP, the MoE block
(router -> fp32 softmax -> top-k -> family normalisation -> ExpertRunner), and the CausalLM itself.

x is [T, H]: the tokens of one forward, of one sequence (a prefill, a decode token, a verify span;
its KV in a contiguous KVCache) or of a whole batch (chunks of many sequences; paged KV). Only
attention tells them apart: it goes through the forward's KVAttention, everything else is per token.
Weights are allocated directly on the target device in the target dtype and then overwritten by
the loader; a freshly built CausalLM holds random weights.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moe_serve.engine.experts.routing import ExpertRunner, LayerRouting, Router, chosen_scores, expert_scores
from moe_serve.engine.kv.paged_attention import sink_attention
from moe_serve.engine.kv.paged_cache import PagedStep
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.models.config import ModelConfig
from moe_serve.engine.models.rope import RotaryEmbedding, apply_rotary

AttentionHook = Callable[[int, torch.Tensor], None]  # (decoder layer index, h [T, H])


class KVAttention(Protocol):
    def attend(self, layer: int, window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store this forward's k, v [T, nkv, D] and attend q [T, nq, D] over the cache -> [T, nq*D],
        softmax(q.k * scale) (None: D ** -0.5); with sinks (fp32 [nq], gpt-oss), each query head's
        softmax also takes its sink logit, a column with no value."""
        ...


@dataclass(frozen=True)
class _Step:
    """What every layer needs to know about the current forward."""

    cos: torch.Tensor  # [T, 1, D]
    sin: torch.Tensor  # [T, 1, D]
    attention: KVAttention
    runner: ExpertRunner | None
    moe_top_r: int | None
    on_attention_output: AttentionHook | None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel on CUDA (accumulating in fp32) where the HF order (upcast, normalise,
        # cast back, scale) takes eight: a decode step runs four norms per layer. The scale is
        # applied before the one rounding, so bf16 results can differ from HF's in the last bit.
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=bias, dtype=dtype)  # gate rows, then up rows
        self.down = nn.Linear(intermediate, hidden, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # [T, I] each
        return self.down(F.silu(gate) * up)  # [T, H]


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qk_norm = config.qk_norm
        self.clip_qkv = config.clip_qkv
        self.window = config.attention_windows[layer]
        self.scale = config.attention_scale
        h = config.hidden_size
        self.qkv = nn.Linear(h, self.q_size + 2 * self.kv_size, bias=config.qkv_bias, dtype=dtype)
        self.o = nn.Linear(self.q_size, h, bias=config.o_bias, dtype=dtype)
        # fp32 as the softmax they join (attention paths compute it in fp32)
        self.sinks = (nn.Parameter(torch.zeros(config.num_heads, dtype=torch.float32)) if config.attention_sinks
                      else None)
        if config.qk_norm != "none":
            q_dim, k_dim = (self.head_dim, self.head_dim) if config.qk_norm == "per_head" else (self.q_size, self.kv_size)
            self.q_norm = RMSNorm(q_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(k_dim, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, step: _Step) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)  # [T, nq*D], [T, nkv*D] x2
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (y.clamp(-self.clip_qkv, self.clip_qkv) for y in (q, k, v))
        q = q.view(t, -1, self.head_dim)  # [T, nq, D]
        k = k.view(t, -1, self.head_dim)  # [T, nkv, D]
        v = v.view(t, -1, self.head_dim)  # [T, nkv, D]
        if self.qk_norm == "per_head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, step.cos, step.sin), apply_rotary(k, step.cos, step.sin)
        out = step.attention.attend(self.layer, self.window, q, k, v, self.scale, self.sinks)  # [T, nq*D]
        return self.o(out)  # [T, H]


class LatentAttentionLayer(nn.Module):
    """DeepSeek's multi-head latent attention, computed over the latent itself (the absorbed form).

    Every head's key is k_nope = W_uk c plus a roped part k_pe shared by the heads, and its value
    W_uv c, for the token's latent c. So q.k = (W_uk^T q_nope).c + q_pe.k_pe: with each head's
    query carried into the latent's space, all heads attend over ONE key per token, [c, k_pe],
    whose first kv_lora_rank dims also serve as the value; W_uv then maps each head's weighted
    latent out. The cache holds that one key per token (kv_lora_rank + qk_rope_head_dim wide: 576
    for DeepSeek-V2/V3), not 2 x heads x head dims (V3: 128 x 2 x ~160), and the attention kernels
    see multi-query attention with a custom scale.
    """

    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        mla = config.mla
        self.layer, self.mla = layer, mla
        self.window = config.attention_windows[layer]
        self.scale = config.attention_scale
        self.num_heads = config.num_heads
        h, heads = config.hidden_size, config.num_heads
        q_dim = heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        if mla.q_lora_rank is None:
            self.q = nn.Linear(h, q_dim, bias=False, dtype=dtype)
        else:
            self.q_a = nn.Linear(h, mla.q_lora_rank, bias=config.qkv_bias, dtype=dtype)
            self.q_a_norm = RMSNorm(mla.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b = nn.Linear(mla.q_lora_rank, q_dim, bias=False, dtype=dtype)
        self.kv_a = nn.Linear(h, mla.kv_lora_rank + mla.qk_rope_head_dim, bias=config.qkv_bias, dtype=dtype)
        self.kv_a_norm = RMSNorm(mla.kv_lora_rank, config.rms_norm_eps, dtype)
        # [heads * (nope + v), kv_lora_rank]: read as W_uk and W_uv, never applied to the latent
        self.kv_b = nn.Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False,
                              dtype=dtype)
        self.o = nn.Linear(heads * mla.v_head_dim, h, bias=config.o_bias, dtype=dtype)

    def forward(self, x: torch.Tensor, step: _Step) -> torch.Tensor:
        mla, t, heads = self.mla, x.shape[0], self.num_heads
        nope, rank = mla.qk_nope_head_dim, mla.kv_lora_rank
        q = self.q(x) if mla.q_lora_rank is None else self.q_b(self.q_a_norm(self.q_a(x)))
        q_nope, q_pe = q.view(t, heads, -1).split([nope, mla.qk_rope_head_dim], dim=-1)  # [T, n, nope], [T, n, R]
        latent, k_pe = self.kv_a(x).split([rank, mla.qk_rope_head_dim], dim=-1)  # [T, C], [T, R]
        latent = self.kv_a_norm(latent)
        k_pe = k_pe[:, None]  # [T, 1, R]
        # roped dims in halves, as apply_rotary turns them: an interleaved checkpoint's rows are reordered at load
        q_pe, k_pe = apply_rotary(q_pe, step.cos, step.sin), apply_rotary(k_pe, step.cos, step.sin)
        w = self.kv_b.weight.view(heads, nope + mla.v_head_dim, rank)  # [n, nope + v, C]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w[:, :nope]).transpose(0, 1)  # [T, n, C]
        key = torch.cat([latent[:, None], k_pe], dim=-1)  # [T, 1, C + R]: the latent is the value too
        out = step.attention.attend(self.layer, self.window, torch.cat([q_latent, q_pe], dim=-1), key, key,
                                    self.scale)  # [T, n * (C + R)]
        weighted = out.view(t, heads, -1)[..., :rank]  # [T, n, C]
        values = torch.bmm(weighted.transpose(0, 1), w[:, nope:].transpose(1, 2))  # [n, T, v]
        return self.o(values.transpose(0, 1).reshape(t, -1))  # [T, H]


@dataclass(frozen=True)
class SequenceAttention:
    """One sequence's forward over its contiguous KVCache (speculative decoding and its graphs)."""

    kv: KVCache
    start: int
    masks: dict[int | None, torch.Tensor | None]  # attention window -> bool mask [T, S] (None: causal or none needed)
    positions: torch.Tensor | None = None  # [T] on device: static-shape (graph) forward
    span: int = 0  # keys every query attends over in a static-shape forward

    def attend(self, layer: int, window: int | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               scale: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        if self.positions is None:
            keys, values = self.kv.write(layer, self.start, k, v)  # [S, nkv, D] each
        else:
            keys, values = self.kv.write_at(layer, self.positions, k, v, self.span)  # [span, nkv, D]
        return self._attend(q, keys, values, self.masks[window], self.start == 0 and q.shape[0] > 1, scale,
                            sinks)  # [T, nq*D]

    @staticmethod
    def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                causal: bool, scale: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """q [T, nq, D] over keys/values [S, nkv, D] -> [T, nq*D].

        Batched 4-D inputs, because SDPA's fused kernels take nothing else: 3-D ones fall back to
        the math path, which upcasts the whole K/V span to fp32 every layer. A mask rules flash
        out and the memory-efficient kernel has no GQA, so then each KV head's query group is
        folded into the query rows instead of repeating K/V (HF's head order: kv head j serves
        query heads j*g .. j*g+g-1). SDPA takes no sink: with sinks, sink_attention writes the
        softmax out in fp32.
        """
        t, nq, d = q.shape
        if sinks is not None:  # the forward built its masks explicit (attention_mask)
            out = sink_attention(q, keys, values, mask, d ** -0.5 if scale is None else scale, sinks)
            return out.reshape(t, nq * d)
        nkv = keys.shape[1]
        k4, v4 = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, nkv, S, D]
        if mask is not None and nq != nkv:
            g = nq // nkv
            q4 = q.view(t, nkv, g, d).permute(1, 2, 0, 3).reshape(1, nkv, g * t, d)  # rows (i, t) per kv head
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask.repeat(g, 1)[None, None], scale=scale)
            return out.view(nkv, g, t, d).permute(2, 0, 1, 3).reshape(t, nq * d)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k4, v4,  # [1, nq, T, D]
            attn_mask=None if mask is None else mask[None, None],
            is_causal=mask is None and causal,
            enable_gqa=nq != nkv,
            scale=scale,
        )  # [1, nq, T, D]
        return out[0].transpose(0, 1).reshape(t, nq * d)


def route(router_logits: torch.Tensor, top_k: int, normalize: bool, router: Router = Router(),
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(expert_ids [T, k], weights [T, k] fp32, probs [T, E] fp32) from router logits [T, E]: the
    experts choose_experts picks, weighed by their scores (never the correction), renormalised if
    `normalize`, times router.scaling."""
    probs = expert_scores(router_logits, router)  # [T, E]
    weights, ids = chosen_scores(probs, top_k, router, correction)  # [T, k], best first
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights * router.scaling if router.scaling != 1.0 else weights, probs


class MoEBlock(nn.Module):
    def __init__(self, config: ModelConfig, moe_layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe_layer = moe_layer
        self.top_k = config.top_k
        self.normalize = config.norm_topk_prob
        self.router_config = config.router
        h = config.hidden_size
        self.router = nn.Linear(h, config.num_experts, bias=config.router_logit_bias, dtype=dtype)
        # picks experts, never weighs them: fp32, as it is added to fp32 probabilities
        self.router_bias = (nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32))
                            if config.router.correction_bias else None)
        self.shared: SwiGLU | None = None
        self.shared_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared = SwiGLU(h, config.shared_expert_intermediate_size, False, dtype)
            if config.shared_expert_gated:
                self.shared_gate = nn.Linear(h, 1, bias=False, dtype=dtype)

    def routing(self, x: torch.Tensor, top_r: int | None) -> LayerRouting:
        """Route x [T, H]; with top_r, keep only each token's r best experts (SS-MoE self-draft),
        offering the runner the whole top-k to pick resident ones from."""
        ids, weights, probs = route(self.router(x), self.top_k, self.normalize, self.router_config,
                                    self.router_bias)  # [T, K], best first
        routing = LayerRouting(self.moe_layer, ids, weights, probs, normalize=self.normalize,
                               scale=self.router_config.scaling)
        if top_r is None or top_r >= self.top_k:
            return routing
        best = ids[:, :top_r]  # [T, r]
        return replace(routing, expert_ids=best, expert_weights=routing.reweighted(best), candidates=ids)

    def forward(self, x: torch.Tensor, runner: ExpertRunner, top_r: int | None) -> torch.Tensor:
        out = runner.run(x, self.routing(x, top_r))  # [T, H]
        if self.shared_gate is not None:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        elif self.shared is not None:
            out = out + self.shared(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.attn = (Attention(config, layer, dtype) if config.mla is None
                     else LatentAttentionLayer(config, layer, dtype))
        self.mlp_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        moe_layer = config.moe_index(layer)
        self.mlp: MoEBlock | SwiGLU
        if moe_layer is None:
            self.mlp = SwiGLU(config.hidden_size, config.intermediate_size, config.mlp_bias, dtype)
        else:
            self.mlp = MoEBlock(config, moe_layer, dtype)

    def forward(self, x: torch.Tensor, step: _Step) -> torch.Tensor:
        h = x + self.attn(self.attn_norm(x), step)  # [T, H]
        if step.on_attention_output is not None:
            step.on_attention_output(self.layer, h)
        y = self.mlp_norm(h)
        if isinstance(self.mlp, MoEBlock):
            return h + self.mlp(y, step.runner, step.moe_top_r)
        return h + self.mlp(y)


def static_attention_mask(positions: torch.Tensor, span: int, window: int | None) -> torch.Tensor:
    """Bool mask [T, span] for queries at device positions [T] over keys 0..span-1 (graph safe)."""
    q_pos = positions[:, None]  # [T, 1]
    k_pos = torch.arange(span, device=positions.device)[None, :]  # [1, span]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def attention_mask(start: int, length: int, window: int | None, device: torch.device,
                   explicit: bool = False) -> torch.Tensor | None:
    """Bool mask [T, S] (True = attend) for queries at start..start+T-1 over keys 0..start+T-1.

    None when SDPA needs no mask: a single query with its whole past in the window, or a prefill
    from position 0 that SDPA's own is_causal handles; always a mask when `explicit` (attention
    with sinks, whose softmax is not SDPA's).
    """
    end = start + length
    if not explicit and (window is None or window >= end):
        if length == 1 or start == 0:
            return None
    q_pos = torch.arange(start, end, device=device)[:, None]  # [T, 1]
    k_pos = torch.arange(end, device=device)[None, :]  # [1, S]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


class CausalLM(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        runner: ExpertRunner | None,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        if config.is_moe and runner is None:
            raise ValueError(f"{config.architecture} is an MoE model: an ExpertRunner is required")
        self.config = config
        # bypass nn.Module registration: a runner that is itself a Module must not become a child
        # whose tensors the loader would expect or .to() would move
        object.__setattr__(self, "runner", runner)
        with torch.device(device):
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(DecoderLayer(config, i, dtype) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
            self.rotary = RotaryEmbedding(config.rope, config.rope_dim)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def router_weights(self) -> list[torch.Tensor]:
        """Each MoE layer's router weight [E, H], in MoE-layer order (for routing predictors)."""
        return [layer.mlp.router.weight for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def router_logit_biases(self) -> list[torch.Tensor] | None:
        """Each MoE layer's router bias [E] (gpt-oss), in MoE-layer order; None where routers have none."""
        if not self.config.router_logit_bias:
            return None
        return [layer.mlp.router.bias for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    def router_corrections(self) -> list[torch.Tensor] | None:
        """Each MoE layer's correction bias [E] (DeepSeek-V3, GLM-4.5), in MoE-layer order; None
        where the family's router has none."""
        if not self.config.router.correction_bias:
            return None
        return [layer.mlp.router_bias for layer in self.layers if isinstance(layer.mlp, MoEBlock)]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        start_pos: int,
        kv: KVCache,
        *,
        moe_top_r: int | None = None,
        on_attention_output: AttentionHook | None = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Logits [T, V] (or [1, V] with last_only) for input_ids [T] at positions start_pos.. .

        Writes their keys/values into kv and sets kv.length = start_pos + T; start_pos must equal
        kv.length (truncate first to roll back).
        """
        if start_pos != kv.length:
            raise ValueError(f"start_pos {start_pos} != kv.length {kv.length}: truncate the cache first")
        if moe_top_r is not None and moe_top_r < 1:
            raise ValueError(f"moe_top_r must be >= 1, got {moe_top_r}")
        t = input_ids.shape[0]
        cos, sin = self.rotary.cos_sin(start_pos, t, self.dtype)
        # built once a forward for every layer (sink attention takes no is_causal: it needs them all)
        masks = {w: attention_mask(start_pos, t, w, self.device, explicit=self.config.attention_sinks)
                 for w in set(self.config.attention_windows)}
        step = _Step(cos, sin, SequenceAttention(kv, start_pos, masks), self.runner, moe_top_r, on_attention_output)
        logits = self._layers_and_head(input_ids, step, last_only)
        kv.length = start_pos + t
        return logits

    @torch.inference_mode()
    def forward_batch(self, input_ids: torch.Tensor, paged: PagedStep, chunks: list[tuple[int, int]] | None,
                      logit_rows: torch.Tensor | None, moe_top_r: int | None = None) -> torch.Tensor:
        """Logits [R, V] of rows logit_rows [R] (all T rows when None) of a batch of sequences' tokens [T].

        `paged` says where each token belongs; `chunks` ((start, length) per sequence, in feeding
        order) is needed only by dynamic-NTK RoPE, whose frequencies depend on each sequence's length.
        moe_top_r: run only that many of each token's top-k experts (a self-draft, SS-MoE).
        """
        if moe_top_r is not None and moe_top_r < 1:
            raise ValueError(f"moe_top_r must be >= 1, got {moe_top_r}")
        cos, sin = (self.rotary.cos_sin_chunks(chunks, self.dtype) if self.rotary.rope.rope_type == "dynamic"
                    else self.rotary.cos_sin_at(paged.positions, self.dtype))
        step = _Step(cos, sin, paged, self.runner, moe_top_r, None)
        x = self._layers(input_ids, step)  # [T, H]
        if logit_rows is not None:
            x = x.index_select(0, logit_rows)  # [R, H]
        return self.lm_head(self.norm(x))  # [R, V]

    @property
    def supports_static_forward(self) -> bool:
        """Dynamic-NTK RoPE depends on the host-side sequence length, so it cannot be captured."""
        return self.config.rope.rope_type != "dynamic"

    @torch.inference_mode()
    def forward_static(self, input_ids: torch.Tensor, positions: torch.Tensor, span: int, kv: KVCache, *,
                       moe_top_r: int | None = None, on_attention_output: AttentionHook | None = None) -> torch.Tensor:
        """Logits [T, V] with every shape fixed by (T, span) and positions a device tensor [T].

        What a CUDA graph captures: queries attend over the first `span` cache entries, masked by
        position. Leaves kv.length alone (the caller advances it after a replay). A hook is
        captured too, so it may only do device work.
        """
        cos, sin = self.rotary.cos_sin_at(positions, self.dtype)
        masks = {w: static_attention_mask(positions, span, w) for w in set(self.config.attention_windows)}
        attention = SequenceAttention(kv, 0, masks, positions, span)
        step = _Step(cos, sin, attention, self.runner, moe_top_r, on_attention_output)
        return self._layers_and_head(input_ids, step, last_only=False)

    def _layers(self, input_ids: torch.Tensor, step: _Step) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, H]
        for layer in self.layers:
            x = layer(x, step)
        return x  # [T, H]

    def _layers_and_head(self, input_ids: torch.Tensor, step: _Step, last_only: bool) -> torch.Tensor:
        x = self._layers(input_ids, step)
        if last_only:
            x = x[-1:]
        return self.lm_head(self.norm(x))  # [T, V]
