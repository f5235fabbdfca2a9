"""Attention over the paged KV cache: each query token reads its own sequence's blocks.

One layer's cache is k_cache/v_cache [num_blocks, block_size, nkv, D]; a sequence's position p
lives in block block_tables[s, p // block_size] at row p % block_size. Query t (of sequence
query_seq[t], at position query_pos[t]) attends causally to positions 0..query_pos[t] of its
sequence, and with a sliding `window` only to positions > query_pos[t] - window. Its own key and
value are already in the cache. A query at a negative position (a padding slot of a captured
batch) attends to nothing and returns zeros. With `sinks` (gpt-oss), each query head's softmax
also takes that head's learned logit, a column with no value, so a head can attend to "nothing".

Two paths behind `paged_attention`:
1. `paged_attention_torch`, the reference: gathers every query's blocks up to the host bound
   `max_span`, masks by position and window, softmax in fp32. Runs anywhere.
2. `paged_attention_triton`, one program per (query token, kv head) that reads K/V blocks in
   place through the block table (no gather copy), the kv head's g query heads together as the
   rows of a tl.dot, looping over key tiles up to the query's own position with an online
   softmax (flash-decoding style). Loop bounds come from the device tensors: no host sync, CUDA
   graphs capture it.

Both accumulate in fp32 and cast to q's dtype once. Triton is imported guarded, so the module
imports where it is absent (CPU CI).

Long runs of one sequence's queries (prefill chunks) attend per sequence with SDPA instead: its
keys gathered once, then one fused attention call. Measured on the H100 (bench/results/attention/):
a 512-token chunk over 2,048 keys takes 0.69 ms in the Triton kernel (each query re-reads the
sequence's K/V) and 0.09 ms gathered + SDPA, while decode batches and 5-token verify spans are
2-4x faster in the kernel. The runs come from the host's step layout of an eager step, so
choosing them costs no sync; CUDA-graphed decode steps have none. SDPA takes no sink: with sinks,
the runs take sink_attention, the same math written out in fp32.

Kernel limits: any head_dim up to MAX_KERNEL_HEAD_DIM (padded to a power of two >= 16 and
masked) and any block_size; the
g query heads of a kv head are padded to tl.dot's 16 rows (free while memory-bound). q and the
cache must share a dtype (bf16, fp16, fp32). One program per (token, kv head) and no split over
the keys, so few long sequences underfill the GPU (8 x 8192 keys: ~1.4 TB/s on H100, against
~2.9 TB/s for 64 x 2048). Each query re-reads its sequence's K/V, so long prefills belong to
a prefill kernel; verify spans of a few tokens hit L2 instead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: paged_attention keeps the torch path
    triton = None

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Elements of gathered K (and as many of V) per chunk of queries in the torch path: bounds its
# memory at long prefills, where T queries each gather max_span keys.
_TORCH_GATHER_ELEMENTS = 1 << 24
# One sequence's queries in a step from which SDPA over its gathered keys beats the Triton kernel on
# a GPU: 5 queries are faster in the kernel, 512 are 3-8x faster in SDPA (bench/results/attention/);
# the crossover between was not measured.
PREFILL_RUN_MIN_QUERIES = 128
# The widest head the kernel takes. Its tiles are keys_per_step x the head padded to a power of two,
# K's and V's each in shared memory with 3 pipeline stages: 128 x 256 bf16 tiles fill an H100's
# 228 KB already. DeepSeek's latent attention (one 576-wide head) takes the torch path until a
# kernel with narrower tiles is measured.
MAX_KERNEL_HEAD_DIM = 256


@dataclass(frozen=True)
class QueryRun:
    """Consecutive queries [start, end) of one sequence (row `seq` of the block tables), whose keys
    are positions 0..span-1: the unit the per-sequence path attends."""
    start: int
    end: int
    seq: int
    span: int


def query_runs(query_seq: list[int], positions: list[int]) -> list[QueryRun]:
    """The runs of a step's queries, from host lists."""
    runs, start = [], 0
    while start < len(query_seq):
        end = start
        while end < len(query_seq) and query_seq[end] == query_seq[start]:
            end += 1
        runs.append(QueryRun(start, end, query_seq[start], max(positions[start:end]) + 1))
        start = end
    return runs


@dataclass(frozen=True)
class PagedAttentionConfig:
    """Key positions per loop step of a program (a power of two >= 16, tl.dot's minimum), warps, pipeline stages.

    The defaults were best or within ~5% of the best on H100 (nkv 8, g 4, D 128, bf16) from 64
    sequences x 512 keys to 8 x 8192 and with 1 to 4 queries per sequence.
    """
    keys_per_step: int = 128
    num_warps: int = 4
    num_stages: int = 3


def paged_attention_available(device: torch.device | str) -> bool:
    """Triton is importable and `device` is a GPU it compiles for."""
    return triton is not None and torch.device(device).type == "cuda"


def paged_attention_supported(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """The Triton path applies: a GPU, triton, one supported dtype for q and the cache, packed head dims
    of at most MAX_KERNEL_HEAD_DIM."""
    return (paged_attention_available(q.device) and q.dtype in SUPPORTED_DTYPES and q.shape[-1] <= MAX_KERNEL_HEAD_DIM
            and k_cache.dtype == q.dtype and v_cache.dtype == q.dtype
            and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_seq: torch.Tensor, query_pos: torch.Tensor, *, scale: float, window: int | None,
                    max_span: int, prefill_runs: tuple[QueryRun, ...] = (),
                    other_queries: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, nq, D] over one layer's paged cache [num_blocks, block_size, nkv, D] -> [T, nq, D] in q's dtype.

    block_tables [B, max_blocks] int32; query_seq [T] (a row of block_tables) and query_pos [T]
    (absolute position) per query; max_span >= max(query_pos) + 1, read by the torch path only.
    prefill_runs: runs of at least PREFILL_RUN_MIN_QUERIES queries, which a GPU attends per sequence;
    other_queries: the indices of every query outside them (both from the host's step layout).
    sinks: fp32 [nq], each query head's sink logit (gpt-oss): one more softmax column, with no value.
    """
    if paged_attention_supported(q, k_cache, v_cache):
        if not prefill_runs:
            return paged_attention_triton(q, k_cache, v_cache, block_tables, query_seq, query_pos, scale=scale,
                                          window=window, sinks=sinks)
        out = torch.empty_like(q)
        if other_queries is not None and other_queries.numel():
            out[other_queries] = paged_attention_triton(q[other_queries], k_cache, v_cache, block_tables,
                                                        query_seq[other_queries], query_pos[other_queries],
                                                        scale=scale, window=window, sinks=sinks)
        for run in prefill_runs:
            out[run.start:run.end] = _attend_run(q, k_cache, v_cache, block_tables, query_pos, run, scale, window,
                                                 sinks)
        return out
    if q.device.type == "cpu":
        return paged_attention_per_sequence(q, k_cache, v_cache, block_tables, query_seq, query_pos, scale=scale,
                                            window=window, sinks=sinks)
    return paged_attention_torch(q, k_cache, v_cache, block_tables, query_seq, query_pos, scale=scale,
                                 window=window, max_span=max_span, sinks=sinks)


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_seq: torch.Tensor, query_pos: torch.Tensor, *, scale: float, window: int | None,
                          max_span: int, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The reference: gather each query's first max_span key positions, mask, fp32 softmax.

    Shapes depend on host ints only (T, max_span), so CUDA graphs capture it too.
    """
    t, nq, d = q.shape
    block_size = k_cache.shape[1]
    span = max(0, min(max_span, block_tables.shape[1] * block_size))  # no position lies past the table
    out = torch.zeros_like(q)  # [T, nq, D]
    per_query = max(1, span * k_cache.shape[2] * d)
    step = max(1, _TORCH_GATHER_ELEMENTS // per_query)
    for lo in range(0, t if span else 0, step):
        rows = slice(lo, min(t, lo + step))
        out[rows] = _attend_gathered(q[rows], k_cache, v_cache, block_tables, query_seq[rows], query_pos[rows],
                                     scale, window, span, sinks)
    return out


def _attend_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     query_seq: torch.Tensor, query_pos: torch.Tensor, scale: float, window: int | None,
                     span: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """One chunk of queries q [T, nq, D] over their sequences' keys 0..span-1 -> [T, nq, D]."""
    t, nq, d = q.shape
    num_blocks, block_size, nkv, _ = k_cache.shape
    tables = block_tables[query_seq.long(), : -(-span // block_size)].long()  # [T, nb]
    # Entries past a sequence's length are arbitrary: clamp so the gather stays in bounds; the mask drops them.
    tables = tables.clamp(0, num_blocks - 1)
    keys = k_cache[tables].flatten(1, 2)[:, :span].float()  # [T, span, nkv, D]
    values = v_cache[tables].flatten(1, 2)[:, :span].float()  # [T, span, nkv, D]
    allowed = _allowed(query_pos, span, window)  # [T, span]
    # Unwritten rows may hold NaN (torch.empty caches), and 0 * NaN is NaN: zero them, not just their weight.
    values = values.masked_fill(~allowed[:, :, None, None], 0.0)
    g = nq // nkv
    out = masked_attention(q.view(t, nkv, g, d),  # kv head j serves query heads j*g..j*g+g-1
                           keys.transpose(1, 2), values.transpose(1, 2),  # [T, nkv, span, D]
                           allowed[:, None, None, :], scale, None if sinks is None else sinks.view(nkv, g))
    return out.reshape(t, nq, d).to(q.dtype)  # [T, nkv, g, D] -> [T, nq, D]


def paged_attention_per_sequence(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                 block_tables: torch.Tensor, query_seq: torch.Tensor, query_pos: torch.Tensor, *,
                                 scale: float, window: int | None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The CPU path: each run of one sequence's queries gathers that sequence's keys once and attends
    with SDPA. The reference gathers every query's keys (a 1024-token prefill chunk copies 1024 x
    1024 positions per layer, ~30 s on a CPU core); reading the runs costs a host sync, which is
    free on a CPU and why the GPU without triton keeps the reference (CUDA graphs capture that).
    """
    out = torch.zeros_like(q)  # queries at negative positions (padding) stay zeros
    for run in query_runs(query_seq.tolist(), query_pos.tolist()):
        if run.span > 0:
            out[run.start:run.end] = _attend_run(q, k_cache, v_cache, block_tables, query_pos, run, scale, window,
                                                 sinks)
    return out


def _attend_run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                query_pos: torch.Tensor, run: QueryRun, scale: float, window: int | None,
                sinks: torch.Tensor | None) -> torch.Tensor:
    """One run's queries over its sequence's keys, gathered once -> [L, nq, D] in q's dtype. SDPA
    computes in q's dtype on a GPU (its fused kernels accumulate in fp32), in fp32 on a CPU; it takes
    no sink, so with sinks the run goes through sink_attention in fp32."""
    block_size, groups = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    compute = q.dtype if q.device.type == "cuda" else torch.float32
    blocks = block_tables[run.seq, : -(-run.span // block_size)].long()
    keys = k_cache[blocks].flatten(0, 1)[:run.span]  # [span, nkv, D]
    values = v_cache[blocks].flatten(0, 1)[:run.span]
    allowed = _allowed(query_pos[run.start:run.end], run.span, window)  # [L, span]
    if sinks is not None:
        return sink_attention(q[run.start:run.end], keys, values, allowed, scale, sinks)
    seen = allowed.any(dim=1)  # a padding query sees nothing: SDPA would give NaN
    attn = F.scaled_dot_product_attention(
        q[run.start:run.end].transpose(0, 1).to(compute),  # [nq, L, D]
        keys.transpose(0, 1).to(compute).repeat_interleave(groups, dim=0),  # [nq, span, D]
        values.transpose(0, 1).to(compute).repeat_interleave(groups, dim=0),
        attn_mask=allowed | ~seen[:, None], scale=scale)  # [nq, L, D]
    return attn.transpose(0, 1).masked_fill(~seen[:, None, None], 0.0).to(q.dtype)


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float,
                   sinks: torch.Tensor) -> torch.Tensor:
    """q [L, nq, D] over one sequence's keys/values [S, nkv, D], query l seeing the keys allowed [L, S]
    marks, each query head's softmax taking its sink logit sinks [nq] too -> [L, nq, D] in q's dtype.

    The explicit fp32 path where SDPA would run, which has no sink column. Chunks of queries bound
    its scores (and their softmax copies) to _TORCH_GATHER_ELEMENTS, as the reference bounds its
    gathered keys: a 4,096-token prefill over 64 heads would hold 2^30 fp32 scores at once.
    """
    t, nq, d = q.shape
    span, nkv = keys.shape[:2]
    g = nq // nkv
    # Each kv head's query group folded into its rows (head i of the group, then query l), so the
    # keys are shared by the group as they are, never repeated.
    keys, values = keys.transpose(0, 1).float(), values.transpose(0, 1).float()  # [nkv, S, D]
    group_sinks = sinks.view(nkv, g, 1)
    out = torch.empty_like(q)
    step = max(1, _TORCH_GATHER_ELEMENTS // max(1, nq * span))
    for lo in range(0, t, step):
        rows = slice(lo, min(t, lo + step))
        n = rows.stop - lo
        q_rows = q[rows].reshape(n, nkv, g, d).permute(1, 2, 0, 3).reshape(nkv, g * n, d)  # rows (i, l) per kv head
        got = masked_attention(q_rows, keys, values, allowed[rows].repeat(g, 1), scale,
                               group_sinks.expand(nkv, g, n).reshape(nkv, g * n))  # [nkv, g * n, D]
        out[rows] = got.view(nkv, g, n, d).permute(2, 0, 1, 3).reshape(n, nq, d)
    return out


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, allowed: torch.Tensor, scale: float,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention written out in fp32: query rows q [..., R, D] over keys/values [..., S, D] (the same
    leading dims), row r seeing the keys `allowed` [..., R, S] (broadcast) marks -> fp32 [..., R, D].

    With sinks [..., R] (broadcast), each row's softmax also takes its sink logit, a column that
    has no value (gpt-oss): out = sum_j e^l_j v_j / (sum_j e^l_j + e^sink), as in transformers'
    eager_attention_forward. A row that sees no key (a padding query) gets zeros either way.
    """
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale  # [..., R, S]
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)  # NaN where a row sees no key
    else:
        sink_column = sinks.float().expand(scores.shape[:-1])[..., None]  # [..., R, 1]
        probs = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    probs = probs.masked_fill(~allowed.any(dim=-1, keepdim=True), 0.0)
    return torch.matmul(probs, values.float())


def _allowed(query_pos: torch.Tensor, span: int, window: int | None) -> torch.Tensor:
    """Bool [T, span]: key position k is visible to the query at p when k <= p (and k > p - window)."""
    q_pos = query_pos.long()[:, None]  # [T, 1]
    k_pos = torch.arange(span, device=query_pos.device)[None, :]  # [1, span]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    return allowed


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                           query_seq: torch.Tensor, query_pos: torch.Tensor, *, scale: float, window: int | None,
                           config: PagedAttentionConfig | None = None,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton kernel, same contract as paged_attention (no max_span: each program reads its own bound).

    Called by the dispatcher on a GPU, and directly on CPU tensors under TRITON_INTERPRET=1 in tests.
    """
    if triton is None:
        raise RuntimeError("paged_attention_triton needs triton")
    t, nq, d = q.shape
    nkv = k_cache.shape[2]
    if nq % nkv or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or window is not None and window < 1:
        raise ValueError(f"need nq % nkv == 0, packed cache head dims and window >= 1; got nq={nq}, nkv={nkv}, "
                         f"strides {k_cache.stride()}, {v_cache.stride()}, window={window}")
    if sinks is not None and (sinks.shape != (nq,) or sinks.dtype != torch.float32 or sinks.stride(0) != 1):
        raise ValueError(f"need sinks packed fp32 [nq={nq}]; got {sinks.dtype} {tuple(sinks.shape)}, "
                         f"strides {sinks.stride()}")
    cfg = config or PagedAttentionConfig()
    g = nq // nkv
    q = q.contiguous()
    out = torch.empty_like(q)  # [T, nq, D], q's strides: the kernel stores at q's offsets
    if t == 0:
        return out
    _paged_attention_kernel[(t, nkv)](
        q, k_cache, v_cache, block_tables, query_seq, query_pos, sinks, out,
        q.stride(0), q.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        scale * math.log2(math.e), window or 0,
        G=g, D=d, BLOCK_SIZE=k_cache.shape[1], HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None,
        BLOCK_G=max(16, triton.next_power_of_2(g)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        TILE=cfg.keys_per_step, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        INTERPRETED=not q.is_cuda, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


if triton is not None:

    @triton.jit
    def _paged_attention_kernel(
        q_ptr, k_ptr, v_ptr, tables_ptr, seq_ptr, pos_ptr, sinks_ptr, out_ptr,
        q_stride_t, q_stride_h, k_stride_b, k_stride_r, k_stride_h, v_stride_b, v_stride_r, v_stride_h,
        table_stride, scale_log2, window,
        G: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        token = tl.program_id(0).to(tl.int64)
        kv_head = tl.program_id(1)
        table = tables_ptr + tl.load(seq_ptr + token).to(tl.int64) * table_stride
        pos = tl.load(pos_ptr + token).to(tl.int32)
        lo = pos * 0  # first visible key position (an int32 tensor in both branches)
        if HAS_WINDOW:
            lo = tl.maximum(pos + 1 - window, 0)
        g = tl.arange(0, BLOCK_G)  # [BLOCK_G] rows: the kv head's query heads, padded to tl.dot's 16
        dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
        heads = kv_head * G + g
        io_mask = (g < G)[:, None] & (dims < D)[None, :]  # [BLOCK_G, BLOCK_D]
        q_off = token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=io_mask, other=0.0)  # [BLOCK_G, BLOCK_D]
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max, log2 units
        denom = tl.zeros([BLOCK_G], tl.float32)
        if HAS_SINKS:
            # The sink as the softmax's first column, one with no value: its logit is the running max
            # and e^0 = 1 the denominator, and the tiles fold in after it. Padded rows (g >= G) take 0,
            # a finite max, and are never stored.
            m = tl.load(sinks_ptr + heads, mask=g < G, other=0.0) * 1.4426950408889634  # log2(e)
            denom += 1.0
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        # Tiles from the one holding lo up to pos: each holds a visible key, so m is finite after the first.
        first = (lo // TILE) * TILE
        if INTERPRETED:  # Triton 3.6's interpreter cannot range() over a loaded bound (numpy 2 refuses int())
            while first <= pos:
                m, denom, acc = _attend_tile(q, m, denom, acc, first, lo, pos, table, k_ptr, v_ptr, dims, kv_head,
                                             k_stride_b, k_stride_r, k_stride_h, v_stride_b, v_stride_r, v_stride_h,
                                             scale_log2, D, BLOCK_SIZE, TILE, PRECISION)
                first += TILE
        else:  # compiled: a for loop, which Triton software-pipelines (up to ~30% faster than while on H100)
            for start in range(first, pos + 1, TILE):
                m, denom, acc = _attend_tile(q, m, denom, acc, start, lo, pos, table, k_ptr, v_ptr, dims, kv_head,
                                             k_stride_b, k_stride_r, k_stride_h, v_stride_b, v_stride_r, v_stride_h,
                                             scale_log2, D, BLOCK_SIZE, TILE, PRECISION)
        # No visible key (a padding query at a negative position): acc is 0, so the output is 0 (denom is
        # then 0, or the sink's 1).
        out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
        tl.store(out_ptr + q_off, out.to(out_ptr.dtype.element_ty), mask=io_mask)  # out has q's strides

    @triton.jit
    def _attend_tile(q, m, denom, acc, start, lo, pos, table, k_ptr, v_ptr, dims, kv_head,
                     k_stride_b, k_stride_r, k_stride_h, v_stride_b, v_stride_r, v_stride_h, scale_log2,
                     D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr):
        """Fold key positions start..start+TILE-1 (those in [lo, pos]) into the online softmax (m, denom, acc)."""
        key_pos = start + tl.arange(0, TILE)  # [TILE]
        key_ok = (key_pos >= lo) & (key_pos <= pos)
        # Masked loads: table entries and cache rows outside [lo, pos] are never read.
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)  # [TILE]
        row = key_pos % BLOCK_SIZE
        kv_mask = key_ok[:, None] & (dims < D)[None, :]  # [TILE, BLOCK_D]
        k_off = block * k_stride_b + row * k_stride_r + kv_head * k_stride_h
        k = tl.load(k_ptr + k_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [TILE, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [BLOCK_G, TILE] fp32
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))  # [BLOCK_G]
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_G, TILE]
        v_off = block * v_stride_b + row * v_stride_r + kv_head * v_stride_h
        v = tl.load(v_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [TILE, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, denom * alpha + tl.sum(p, axis=1), acc
