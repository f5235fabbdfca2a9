"""CUDA graphs of short forwards: a batch's decode tokens, a draft token, a verify span of gamma + 1.

A decode step of a small-active-parameter MoE is hundreds of tiny kernels; launching them from
Python costs more than running them. Each (attention span bucket, top-r, tokens, attention hook)
of one sequence, and each (token bucket, sequence bucket, span bucket) of a batched step (decodes,
with short prefill chunks beside them), gets its own capture; one sequence's spans longer than
MAX_TOKENS and batched steps with long prefill chunks run eagerly.

* Every expert resident (or a dense model): the forward has no host decision left, so it is one graph.
* Experts offloaded: which experts to copy depends on the routing, which only the host's cache
  can act on. The forward is captured piecewise instead: one graph per stretch between two MoE
  layers' expert calls (attention, norms, router, the previous layer's experts). Between two
  replays the runner reads the layer's routing (the one sync the eager path also has), makes
  its experts resident and writes their slot ids into a buffer the next graph reads.

An attention hook (speculative decoding's expert predictor) is captured with the forward, so it
must only do device work into tensors it owns (see moe_serve/engine/speculative/cross_model.py).
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from moe_serve.engine.experts.runner import CachedExpertRunner, CapturedLayer
from moe_serve.engine.kv.paged_attention import PREFILL_RUN_MIN_QUERIES, paged_attention_supported
from moe_serve.engine.kv.paged_cache import PagedKVCache, PagedStep, StepLayout
from moe_serve.engine.kv_cache import KVCache
from moe_serve.engine.models.blocks import AttentionHook

MIN_SPAN = 256
MAX_TOKENS = 16  # verify spans reach gamma + 1; a prefill is too long to be worth a capture per length


def span_bucket(length: int, max_len: int) -> int:
    """Smallest power-of-two span (>= MIN_SPAN, capped at max_len) holding `length` keys."""
    span = MIN_SPAN
    while span < length:
        span *= 2
    return min(span, max_len)


@dataclass(frozen=True)
class _Key:
    span: int
    top_r: int | None
    tokens: int
    hook: AttentionHook | None


@dataclass(frozen=True)
class _Captured:
    inputs: torch.Tensor  # int64 [N], written before each replay: token ids, positions, ...
    segments: list[torch.cuda.CUDAGraph]  # replayed in order; one more than `layers`
    layers: list[CapturedLayer]  # the MoE layer whose expert call ends segment i (piecewise only)
    logits: torch.Tensor  # [T, V], written by the last segment


StaticForward = Callable[[torch.Tensor], torch.Tensor]  # its int64 inputs buffer -> logits [T, V]


class GraphCapture:
    """Fixed-shape forwards captured once per key and replayed: whole when nothing needs the host,
    piecewise around each MoE layer's cache decision when experts are offloaded.

    A forward reads everything that varies (token ids, positions, KV slots, ...) from one int64
    inputs buffer, staged in pinned memory and copied in before each replay."""

    def __init__(self, model: torch.nn.Module, runner: CachedExpertRunner | None, max_inputs: int) -> None:
        self.model, self.runner = model, runner
        self.piecewise = runner is not None and not runner.graph_safe
        if self.piecewise and not runner.replayable:
            raise ValueError("this expert runner makes per-layer host decisions a graph replay cannot")
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Hashable, _Captured] = {}
        # the inputs are written here, then copied to the replayed graph's buffer: a fresh pinned
        # tensor per forward cost ~30 us of host time before every draft token
        self._host_inputs = torch.zeros(max_inputs, dtype=torch.long, pin_memory=True)  # [max_inputs]
        self._inputs_sent = torch.cuda.Event()  # the last copy out of _host_inputs

    def stage(self) -> np.ndarray:
        """The pinned inputs buffer to fill for the next run (waits for the previous copy out of it,
        long done: the previous forward's logits were read)."""
        self._inputs_sent.synchronize()
        return self._host_view

    @cached_property
    def _host_view(self) -> np.ndarray:
        return self._host_inputs.numpy()

    def accepts(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens can be captured (runner.can_replay: a piecewise layer
        computes all its experts in one wave, so the cache must hold them, and a span that needs
        every expert of the model streams eagerly instead)."""
        return not self.piecewise or self.runner.can_replay(tokens)

    def run(self, key: Hashable, num_inputs: int, tokens: int, top_r: int | None, forward: StaticForward) -> torch.Tensor:
        """Logits [T, V] of the forward stored under `key`, fed the first num_inputs staged inputs."""
        inputs = self._host_inputs[:num_inputs]
        captured = self.graphs.get(key)
        if captured is None:
            return self._warm_up_and_capture(key, inputs, forward)
        captured.inputs.copy_(inputs, non_blocking=True)
        self._inputs_sent.record()
        return self._replay(captured, tokens, top_r)

    @torch.inference_mode()  # the captured tensors are inference tensors: the host writes slot ids into them
    def _replay(self, captured: _Captured, tokens: int, top_r: int | None) -> torch.Tensor:
        for i, layer in enumerate(captured.layers):
            captured.segments[i].replay()
            self.runner.replay_layer(layer)
        captured.segments[-1].replay()
        if self.piecewise:
            self.runner.finish_replay()
        elif self.runner is not None:  # one graph, every expert resident: a replay runs no Python
            self.runner.count_replayed_tokens(tokens, top_r or self.model.config.top_k)
        return captured.logits

    def _warm_up_and_capture(self, key: Hashable, host_inputs: torch.Tensor, forward: StaticForward) -> torch.Tensor:
        """Run these inputs eagerly on a side stream (warm-up, counted as usual), then capture."""
        inputs = host_inputs.to(self.model.device)  # the capture's fixed input address
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = forward(inputs)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graphs[key] = self._capture(inputs, forward)
        return logits

    def _capture(self, inputs: torch.Tensor, forward: StaticForward) -> _Captured:
        segments = [torch.cuda.CUDAGraph()]

        def split() -> None:  # the runner ends a segment at each MoE layer's expert call
            segments[-1].capture_end()
            segments.append(torch.cuda.CUDAGraph())
            segments[-1].capture_begin(pool=self.pool, capture_error_mode="thread_local")

        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            segments[0].capture_begin(pool=self.pool, capture_error_mode="thread_local")
            if self.piecewise:
                with self.runner.capturing(split) as layers:
                    logits = forward(inputs)
            else:
                layers = []
                logits = forward(inputs)
            segments[-1].capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        return _Captured(inputs, segments, layers, logits)


class GraphedDecode:
    """One sequence's short forwards (a decode token, a draft token, a verify span) over its contiguous KVCache."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, runner: CachedExpertRunner | None = None) -> None:
        """`runner`: the model's expert runner (None for a dense model)."""
        self.model, self.kv = model, kv
        self.capture = GraphCapture(model, runner, 2 * MAX_TOKENS)

    @property
    def graphs(self) -> dict[Hashable, _Captured]:
        return self.capture.graphs

    @property
    def piecewise(self) -> bool:
        return self.capture.piecewise

    def accepts(self, tokens: int) -> bool:
        """Whether a forward of `tokens` tokens can replay a graph (else it runs eagerly)."""
        return tokens <= MAX_TOKENS and self.capture.accepts(tokens)

    def forward(self, tokens: list[int], moe_top_r: int | None = None,
                on_attention_output: AttentionHook | None = None) -> torch.Tensor:
        """Logits [T, V] of `tokens` at positions kv.length..; advances kv.length by T."""
        pos, t = self.kv.length, len(tokens)
        key = _Key(span_bucket(pos + t, self.kv.max_len), moe_top_r, t, on_attention_output)
        staged = self.capture.stage()
        staged[:t] = tokens
        staged[t : 2 * t] = range(pos, pos + t)

        def forward_static(inputs: torch.Tensor) -> torch.Tensor:  # inputs [2T]: ids, then positions
            ids, positions = inputs.view(2, t)
            return self.model.forward_static(ids, positions, key.span, self.kv, moe_top_r=moe_top_r,
                                             on_attention_output=on_attention_output)

        logits = self.capture.run(key, 2 * t, t, moe_top_r, forward_static)
        self.kv.length = pos + t
        return logits


BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def batch_bucket(size: int) -> int | None:
    """Smallest captured size holding `size` sequences or tokens (None: too many, run eagerly)."""
    return next((b for b in BATCH_BUCKETS if b >= size), None)


class GraphedBatchStep:
    """Steps over the paged KV cache replayed as CUDA graphs: S sequences' chunks, T tokens in all,
    padded to a (token bucket, sequence bucket) shape. A decode step feeds one token per sequence;
    a mixed one also short prefill chunks of newly arrived prompts, which would otherwise run
    eagerly at several times a decode step's cost on a host-bound model (hundreds of launches):
    with many clients a new prompt arrives every few steps.

    What a capture cannot hold runs eagerly: a chunk of PREFILL_RUN_MIN_QUERIES tokens or more
    (attended per sequence by SDPA, chosen on the host), more tokens or sequences than the largest
    bucket, and steps that score prompt tokens. Padding tokens repeat token 0 (its id, position,
    KV slot and sequence): they write the same key and value to the same slot, route to the same
    experts (no extra copies) and are never read. The logits come out for the rows the sampler
    needs only (padded with row 0's), so a mixed step's prefill tokens never reach the LM head."""

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, runner: CachedExpertRunner | None,
                 max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int) -> None:
        self.model, self.cache, self.max_blocks = model, cache, max_blocks
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_batch = batch_bucket(max_num_seqs) or BATCH_BUCKETS[-1]
        self.max_tokens = batch_bucket(max_num_batched_tokens) or BATCH_BUCKETS[-1]
        # inputs: ids, positions, KV slots, sequence rows (a token bucket each), logit rows (up to
        # every token: a verify pass reads all of its), block tables
        self.capture = GraphCapture(model, runner, 5 * self.max_tokens + self.max_batch * (1 + max_blocks))
        # the Triton attention reads every bound from the device, so one capture serves any span; the
        # torch path gathers a host-sized span, and each span bucket is its own capture
        self.spans_differ = not paged_attention_supported(cache.keys[0, :0, 0], cache.keys[0], cache.values[0])

    def accepts(self, chunk_lengths: list[int]) -> bool:
        """Whether a step of chunks of these lengths replays a graph."""
        tokens, batch = batch_bucket(sum(chunk_lengths)), batch_bucket(len(chunk_lengths))
        return (tokens is not None and tokens <= self.max_tokens and batch <= self.max_batch
                and max(chunk_lengths) < PREFILL_RUN_MIN_QUERIES and self.capture.accepts(tokens))

    def forward(self, ids: list[int], layout: StepLayout, rows: list[int], max_model_len: int,
                moe_top_r: int | None = None) -> torch.Tensor:
        """Logits [R, V] of the step's flat token rows `rows` (padded to a bucket too: a decode step
        reads one per sequence, a verify pass all of its tokens)."""
        t, s, w = len(ids), len(layout.tables), self.max_blocks
        tp, sp = batch_bucket(t), batch_bucket(s)
        rp = sp if len(rows) <= sp else batch_bucket(len(rows))  # a verify pass reads more rows than sequences
        pad = tp - t
        staged = self.capture.stage()
        staged[0:tp] = ids + ids[:1] * pad
        staged[tp : 2 * tp] = layout.positions + layout.positions[:1] * pad
        staged[2 * tp : 3 * tp] = layout.slots + layout.slots[:1] * pad
        staged[3 * tp : 4 * tp] = layout.query_seq + [0] * pad
        staged[4 * tp : 4 * tp + rp] = rows + [0] * (rp - len(rows))
        tables = staged[4 * tp + rp : 4 * tp + rp + sp * w].reshape(sp, w)
        tables[:] = 0
        for row, table in enumerate(layout.tables):
            tables[row, : len(table)] = table
        span = span_bucket(layout.max_span if self.spans_differ else max_model_len, max_model_len)

        def forward_static(inputs: torch.Tensor) -> torch.Tensor:
            ids_, positions, slots, query_seq = inputs[: 4 * tp].view(4, tp)
            logit_rows = inputs[4 * tp : 4 * tp + rp]
            step = PagedStep(self.cache, positions, slots, query_seq, inputs[4 * tp + rp :].view(sp, w), span)
            return self.model.forward_batch(ids_, step, None, logit_rows, moe_top_r)  # [rp, V]

        key = (tp, sp, rp, span, moe_top_r)
        return self.capture.run(key, 4 * tp + rp + sp * w, t, moe_top_r, forward_static)[: len(rows)]

    def capture_shapes(self, max_model_len: int, verify_tokens: int | None = None,
                       draft_top_r: int | None = None) -> int:
        """Capture every step shape this engine can replay, before serving; returns how many:
        batched steps, and with batched speculation its verify passes (up to verify_tokens per
        sequence, every row read) and a self-draft's decode steps at draft_top_r experts.

        A shape first met in service is captured there, and its warm-up compiles the Triton kernels
        specialised on it (the expert layout per power of two of pairs, ~1 s each): every sequence in
        that step waits, ~2.6 s once in a 32-client load test. Offloaded experts keep capturing on
        first use: their warm-up forwards would fill the expert cache with what dummy tokens route to,
        and their steps cost tens of milliseconds of copies anyway."""
        if self.capture.piecewise:
            return 0
        plain = step_shapes(self.max_num_seqs, self.max_num_batched_tokens)
        runs = [(lengths, False, None) for lengths in plain]
        if verify_tokens is not None:
            runs += [(lengths, True, None)
                     for lengths in step_shapes(self.max_num_seqs, self.max_num_batched_tokens, verify_tokens)]
        if draft_top_r is not None:
            runs += [(lengths, False, draft_top_r) for lengths in plain if sum(lengths) == len(lengths)]
        block_size, before = self.cache.keys.shape[2], len(self.capture.graphs)
        for lengths, every_row, top_r in runs:
            if self.accepts(lengths):
                # positions 0.. over the first blocks, shared by every sequence: what they write is never read
                layout = StepLayout.of([(list(range(-(-n // block_size))), 0, n) for n in lengths], block_size)
                rows = range(sum(lengths)) if every_row else range(len(lengths))
                self.forward([0] * sum(lengths), layout, list(rows), max_model_len, top_r)
        return len(self.capture.graphs) - before  # a verify of one token per sequence is a decode step


def step_shapes(max_num_seqs: int, max_num_batched_tokens: int,
                max_chunk: int = PREFILL_RUN_MIN_QUERIES - 1) -> list[list[int]]:
    """One step's chunk lengths for each (token bucket, sequence bucket) a scheduler within these
    limits can form from chunks of at most max_chunk tokens (short enough to replay)."""
    shapes = []
    for seq_bucket in BATCH_BUCKETS:
        seqs = min(seq_bucket, max_num_seqs, max_num_batched_tokens)
        for token_bucket in BATCH_BUCKETS:
            tokens = min(token_bucket, max_num_batched_tokens, seqs * max_chunk)
            if tokens >= seqs and batch_bucket(tokens) == token_bucket and batch_bucket(seqs) == seq_bucket:
                shapes.append([tokens // seqs + (row < tokens % seqs) for row in range(seqs)])
    return shapes
