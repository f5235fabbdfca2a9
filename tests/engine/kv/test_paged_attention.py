"""Paged attention equals plain attention over each sequence's contiguous keys and values.

The cache is built the way the block manager lays it out: every sequence's blocks are a random
permutation of the physical blocks, rows past a sequence's length and spare blocks hold NaN, and
block-table entries past a sequence's length point out of range, so either path reading anything
it should not shows up. Queries are the last few positions of each sequence (verify spans and
single decode tokens), shuffled across sequences.

On CPU the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1 must be set before
triton is imported, so those cases run in a subprocess); on a GPU it is compiled, compared in
bf16, and captured in a CUDA graph.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

import moe_serve.engine.kv.paged_attention as pa
from moe_serve.engine.kv.paged_attention import (
    PagedAttentionConfig,
    paged_attention,
    paged_attention_available,
    paged_attention_torch,
)
from moe_serve.engine.kv.paged_cache import PagedKVCache, PagedStep, StepLayout
from tests.triton_interpreter import needs_triton, run_interpreted

# (sequence lengths, queries per sequence, nkv, g, D, block_size, window)
CASES = [
    ([1, 7, 33, 20], [1, 1, 1, 1], 2, 1, 16, 4, None),  # decode tokens, one a first token
    ([9, 40, 17], [3, 5, 1], 2, 2, 16, 4, 6),  # verify spans and a decode token, sliding window
    ([5, 50, 31], [2, 4, 1], 1, 2, 24, 16, None),  # D not a power of two
    ([64, 3], [4, 3], 2, 1, 8, 16, 10),  # a whole prefill from 0 beside a span, window
    ([12, 70], [1, 6], 2, 2, 32, 4, 100),  # window wider than every sequence
    ([26], [26], 1, 4, 16, 16, 7),  # a prefill with g = 4
]
CUDA_CASES = [
    ([1, 300, 1000, 77], [1, 1, 1, 1], 8, 4, 128, 16, None),
    ([513, 64, 200], [5, 5, 1], 8, 4, 128, 16, 128),
    ([100, 250], [1, 4], 4, 2, 80, 16, None),  # D = 80: masked to 128
    ([40, 2000], [8, 1], 2, 8, 64, 32, 4096),
]
# DeepSeek's latent attention: one kv head serving 4 query heads, 40 wide, its values being its keys
# (as_latent), softmax scale from the full head's width
LATENT_CASE = ([9, 40, 17], [3, 5, 1], 1, 4, 40, 4, None)
# Fewer keys per step than most spans: every program loops, and tiles straddle blocks.
TINY = PagedAttentionConfig(keys_per_step=16, num_warps=1)


@dataclass
class Problem:
    q: torch.Tensor  # [T, nq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, nkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, nkv, D]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_seq: torch.Tensor  # [T] int32
    query_pos: torch.Tensor  # [T] int64
    keys: list[torch.Tensor]  # per sequence [len, nkv, D], contiguous
    values: list[torch.Tensor]
    window: int | None
    max_span: int
    scale: float

    def args(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.query_seq, self.query_pos


def make_problem(case: tuple, dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Problem:
    lengths, queries, nkv, g, d, block_size, window = case
    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lengths]
    num_blocks = sum(counts) + 3  # spare blocks, left NaN
    perm = torch.randperm(num_blocks, generator=gen)
    # Junk past each sequence's blocks: out of range, so a read of it would fault or show.
    tables = torch.randint(num_blocks, num_blocks + 1000, (len(lengths), max(counts) + 1), generator=gen)
    k_cache = torch.full((num_blocks, block_size, nkv, d), float("nan"))
    v_cache = torch.full((num_blocks, block_size, nkv, d), float("nan"))
    keys, values, seqs, positions = [], [], [], []
    used = 0
    for s, (n, n_q) in enumerate(zip(lengths, queries)):
        tables[s, : counts[s]] = perm[used : used + counts[s]]
        used += counts[s]
        keys.append(torch.randn(n, nkv, d, generator=gen).to(dtype))  # [len, nkv, D]
        values.append(torch.randn(n, nkv, d, generator=gen).to(dtype))
        pos = torch.arange(n)
        k_cache[tables[s, pos // block_size], pos % block_size] = keys[-1].float()
        v_cache[tables[s, pos // block_size], pos % block_size] = values[-1].float()
        seqs += [s] * n_q
        positions += range(n - n_q, n)
    order = torch.randperm(len(seqs), generator=gen)  # queries of several sequences, any order
    q = torch.randn(len(seqs), nkv * g, d, generator=gen)  # [T, nq, D]
    return Problem(
        q.to(dtype).to(device), k_cache.to(dtype).to(device), v_cache.to(dtype).to(device),
        tables.to(torch.int32).to(device), torch.tensor(seqs, dtype=torch.int32)[order].to(device),
        torch.tensor(positions)[order].to(device), [k.to(device) for k in keys], [v.to(device) for v in values],
        window, max(lengths) + 3, d**-0.5,
    )


def per_sequence(p: Problem) -> Iterator[tuple[torch.Tensor, ...]]:
    """Per sequence: its query rows [n], their queries [nq, n, D], its contiguous keys and values
    [nq, len, D] in fp32, repeated per query head (HF order), and the mask [n, len] of what each query sees."""
    g = p.q.shape[1] // p.keys[0].shape[1]
    for s, (keys, values) in enumerate(zip(p.keys, p.values)):
        rows = (p.query_seq == s).nonzero()[:, 0]  # [n]
        k_pos = torch.arange(keys.shape[0], device=keys.device)[None, :]  # [1, len]
        q_pos = p.query_pos[rows][:, None]  # [n, 1]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - (p.window or keys.shape[0] + 1))  # [n, len]
        k = keys.float().repeat_interleave(g, dim=1).transpose(0, 1)  # [nq, len, D]
        v = values.float().repeat_interleave(g, dim=1).transpose(0, 1)
        yield rows, p.q[rows].float().transpose(0, 1), k, v, mask


def expected(p: Problem) -> torch.Tensor:
    """Plain SDPA per sequence over its contiguous keys/values, fp32."""
    out = torch.zeros(p.q.shape, dtype=torch.float32, device=p.q.device)  # [T, nq, D]
    for rows, q, k, v, mask in per_sequence(p):
        out[rows] = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=p.scale).transpose(0, 1)
    return out


def eager_attention_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                               sinks: torch.Tensor) -> torch.Tensor:
    """gpt-oss's attention as transformers' eager_attention_forward computes it: q [nq, n, D] over
    k, v [nq, len, D] where mask [n, len], each query head's softmax over its scaled scores and its
    sink logit sinks [nq], the sink's column then dropped -> [nq, n, D]."""
    scores = (q @ k.transpose(1, 2) * scale).masked_fill(~mask, float("-inf"))  # [nq, n, len]
    combined = torch.cat([scores, sinks.view(-1, 1, 1).expand(-1, q.shape[1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]  # [nq, n, len]
    return probs @ v


def expected_with_sinks(p: Problem, sinks: torch.Tensor) -> torch.Tensor:
    """eager_attention_with_sinks per sequence over its contiguous keys/values, fp32."""
    out = torch.zeros(p.q.shape, dtype=torch.float32, device=p.q.device)  # [T, nq, D]
    for rows, q, k, v, mask in per_sequence(p):
        out[rows] = eager_attention_with_sinks(q, k, v, mask, p.scale, sinks).transpose(0, 1)  # [n, nq, D]
    return out


def make_sinks(p: Problem, seed: int = 0) -> torch.Tensor:
    """fp32 [nq] sink logits on the scores' scale, so each one takes a real share of its softmax."""
    return torch.randn(p.q.shape[1], generator=torch.Generator().manual_seed(seed)).to(p.q.device)


def as_latent(p: Problem) -> Problem:
    """p with the cache's values being its keys (one tensor, as a latent attention's PagedKVCache
    holds them) and a scale other than D ** -0.5."""
    p.v_cache, p.values, p.scale = p.k_cache, p.keys, 24 ** -0.5
    return p


def torch_path(p: Problem) -> torch.Tensor:
    return paged_attention_torch(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span)


def with_padding_query(p: Problem) -> Problem:
    """One more query at position -1 (a captured batch's padding slot): it must come back as zeros."""
    p.q = torch.cat([p.q, p.q[:1]])
    p.query_seq = torch.cat([p.query_seq, p.query_seq[:1]])
    p.query_pos = torch.cat([p.query_pos, torch.full_like(p.query_pos[:1], -1)])
    return p


@pytest.mark.parametrize("case", CASES)
def test_torch_path_matches_contiguous_sdpa(case):
    p = make_problem(case)
    got = torch_path(p)
    assert got.shape == p.q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected(p), rtol=1e-5, atol=1e-5)


def test_latent_attention_paths_match_contiguous_sdpa():
    p = as_latent(make_problem(LATENT_CASE))
    torch.testing.assert_close(torch_path(p), expected(p), rtol=1e-5, atol=1e-5)
    got = pa.paged_attention_per_sequence(*p.args()[:6], scale=p.scale, window=p.window)
    torch.testing.assert_close(got, expected(p), rtol=1e-5, atol=1e-5)


def test_torch_path_chunks_queries_alike(monkeypatch):
    p = make_problem(CASES[1])
    whole = torch_path(p)
    monkeypatch.setattr(pa, "_TORCH_GATHER_ELEMENTS", 1)  # one query per chunk
    torch.testing.assert_close(torch_path(p), whole, rtol=1e-6, atol=1e-6)  # einsum's batch size may reorder sums


def test_padding_query_gets_zeros():
    p = with_padding_query(make_problem(CASES[3]))
    got = torch_path(p)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    torch.testing.assert_close(got[:-1], expected(make_problem(CASES[3])), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_per_sequence_path_matches_the_reference(case):
    """The CPU path (one gather per run of a sequence's queries, SDPA) against the per-query reference,
    with the queries of several sequences interleaved and a padding query at the end."""
    p = with_padding_query(make_problem(case))
    got = pa.paged_attention_per_sequence(*p.args()[:6], scale=p.scale, window=p.window)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    torch.testing.assert_close(got, torch_path(p), rtol=1e-5, atol=1e-5)


def test_dispatch_takes_the_per_sequence_path_on_cpu():
    assert not paged_attention_available("cpu")
    p = make_problem(CASES[2])
    got = paged_attention(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span)
    torch.testing.assert_close(got, pa.paged_attention_per_sequence(*p.args()[:6], scale=p.scale, window=p.window),
                               rtol=0, atol=0)


PREFILL_CASE = ([300, 40, 9, 200], [pa.PREFILL_RUN_MIN_QUERIES + 20, 3, 1, pa.PREFILL_RUN_MIN_QUERIES],
                2, 2, 16, 16, 150)


def with_prefill_runs(p: Problem) -> tuple[Problem, tuple[pa.QueryRun, ...], torch.Tensor]:
    """p's queries in step order (each sequence's together), its long runs and the other queries' indices."""
    order = torch.sort(p.query_seq, stable=True).indices
    p.q, p.query_seq, p.query_pos = p.q[order], p.query_seq[order], p.query_pos[order]
    runs = tuple(r for r in pa.query_runs(p.query_seq.tolist(), p.query_pos.tolist())
                 if r.end - r.start >= pa.PREFILL_RUN_MIN_QUERIES)
    others = torch.tensor([t for t in range(len(p.q)) if not any(r.start <= t < r.end for r in runs)],
                          device=p.q.device)
    return p, runs, others


@pytest.mark.parametrize("with_sinks", [False, True])
def test_a_gpu_attends_long_prefill_runs_per_sequence_and_the_rest_in_the_kernel(monkeypatch, with_sinks):
    """The split an eager GPU step takes: runs of PREFILL_RUN_MIN_QUERIES or more queries go to SDPA
    (with sinks, sink_attention) over their sequence's gathered keys, every other query to the kernel
    (here the reference stands in for it, on CPU), and together they equal the reference."""
    p, runs, others = with_prefill_runs(make_problem(PREFILL_CASE))
    sinks = make_sinks(p) if with_sinks else None
    assert [r.seq for r in runs] == [0, 3]
    kernel_queries = []

    def kernel(q, k_cache, v_cache, block_tables, query_seq, query_pos, *, scale, window, sinks):
        kernel_queries.append(len(q))
        return paged_attention_torch(q, k_cache, v_cache, block_tables, query_seq, query_pos, scale=scale,
                                     window=window, max_span=p.max_span, sinks=sinks)

    monkeypatch.setattr(pa, "paged_attention_supported", lambda *_: True)
    monkeypatch.setattr(pa, "paged_attention_triton", kernel)
    got = paged_attention(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span, prefill_runs=runs,
                          other_queries=others, sinks=sinks)
    assert kernel_queries == [4]
    reference = paged_attention_torch(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span, sinks=sinks)
    torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5)


def test_a_step_layout_marks_only_long_chunks_as_prefill_runs():
    cache = PagedKVCache(1, 64, 16, 1, 8, device="cpu", dtype=torch.float32)
    long = pa.PREFILL_RUN_MIN_QUERIES
    layout = StepLayout.of([(list(range(20)), 40, 1), (list(range(20, 40)), 0, long), (list(range(40, 60)), 7, 5)], 16)
    step = PagedStep.build(cache, layout, torch.device("cpu"))
    assert step.prefill_runs == (pa.QueryRun(1, 1 + long, 1, long),)
    assert step.other_queries.tolist() == [0, *range(1 + long, 6 + long)]
    short = PagedStep.build(cache, StepLayout.of([(list(range(20)), 40, 1), (list(range(20, 40)), 0, 5)], 16),
                            torch.device("cpu"))
    assert short.prefill_runs == () and short.other_queries is None


# gpt-oss's attention: GQA (nq 4 over nkv 2), block sizes dividing no length, verify spans under a
# sliding window; then a first token (its own key only, against the sink) and a prefill from 0.
SINK_CASES = [
    ([9, 23, 17], [3, 5, 1], 2, 2, 16, 4, 6),
    ([1, 30, 6], [1, 30, 2], 2, 2, 8, 16, None),
]
SINK_PATHS = {
    "torch": lambda p, sinks: paged_attention_torch(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span,
                                                    sinks=sinks),
    "per_sequence": lambda p, sinks: pa.paged_attention_per_sequence(*p.args(), scale=p.scale, window=p.window,
                                                                     sinks=sinks),
}


@pytest.mark.parametrize("case", SINK_CASES)
@pytest.mark.parametrize("path", SINK_PATHS)
def test_paths_with_sinks_match_the_eager_reference(case, path):
    """Several sequences' queries interleaved, and a padding query at position -1 that must stay zeros."""
    p = with_padding_query(make_problem(case))
    sinks = make_sinks(p)
    got = SINK_PATHS[path](p, sinks)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    torch.testing.assert_close(got, expected_with_sinks(p, sinks), rtol=1e-5, atol=1e-5)


def test_paths_with_sinks_chunk_queries_alike(monkeypatch):
    p = with_padding_query(make_problem(SINK_CASES[1]))
    sinks = make_sinks(p)
    whole = {path: attend(p, sinks) for path, attend in SINK_PATHS.items()}
    monkeypatch.setattr(pa, "_TORCH_GATHER_ELEMENTS", 1)  # one query per chunk
    for path, attend in SINK_PATHS.items():
        torch.testing.assert_close(attend(p, sinks), whole[path], rtol=1e-6, atol=1e-6, msg=path)


def test_without_sinks_the_per_sequence_path_keeps_sdpa(monkeypatch):
    """sinks=None never reaches the written-out softmax, and a sink of -inf (which weighs nothing)
    through it gives what SDPA gives."""
    p = with_padding_query(make_problem(SINK_CASES[0]))
    no_weight = torch.full((p.q.shape[1],), float("-inf"))
    with_sink_column = SINK_PATHS["per_sequence"](p, no_weight)

    def fail(*_):
        raise AssertionError("sink_attention without sinks")

    monkeypatch.setattr(pa, "sink_attention", fail)
    sdpa = SINK_PATHS["per_sequence"](p, None)
    assert torch.equal(sdpa, pa.paged_attention_per_sequence(*p.args(), scale=p.scale, window=p.window))
    torch.testing.assert_close(with_sink_column, sdpa, rtol=1e-5, atol=1e-5)


def check_interpreted(cases: list[tuple]) -> None:
    """Run in the subprocess, with TRITON_INTERPRET=1: the fp32 kernel on CPU tensors vs both references."""
    from moe_serve.engine.kv.paged_attention import paged_attention_triton
    for i, case in enumerate(cases):
        p = make_problem(case, seed=i)
        reference = torch_path(p)  # [T, nq, D]
        torch.testing.assert_close(reference, expected(p), rtol=1e-5, atol=1e-5)
        for config in (TINY, None):
            got = paged_attention_triton(*p.args(), scale=p.scale, window=p.window, config=config)
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5, msg=f"{case} {config}")
    p = with_padding_query(make_problem(cases[1]))
    got = paged_attention_triton(*p.args(), scale=p.scale, window=p.window, config=TINY)
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    p = as_latent(make_problem(LATENT_CASE))
    for config in (TINY, None):
        got = paged_attention_triton(*p.args(), scale=p.scale, window=p.window, config=config)
        torch.testing.assert_close(got, expected(p), rtol=1e-5, atol=1e-5, msg=lambda m: f"latent {config}: {m}")


def check_interpreted_sinks(cases: list[tuple]) -> None:
    """Run in the subprocess, with TRITON_INTERPRET=1: the fp32 kernel with sinks on CPU tensors vs
    the eager reference, a padding query included."""
    from moe_serve.engine.kv.paged_attention import paged_attention_triton
    for i, case in enumerate(cases):
        p = with_padding_query(make_problem(case, seed=i))
        sinks = make_sinks(p, seed=i)
        reference = expected_with_sinks(p, sinks)  # [T, nq, D]
        for config in (TINY, None):
            got = paged_attention_triton(*p.args(), scale=p.scale, window=p.window, config=config, sinks=sinks)
            assert torch.equal(got[-1], torch.zeros_like(got[-1]))
            torch.testing.assert_close(got, reference, rtol=1e-5, atol=1e-5, msg=lambda m, case=case, config=config: f"{case} {config}: {m}")


needs_cuda = pytest.mark.skipif(not (torch.cuda.is_available() and paged_attention_available("cuda")),
                                reason="needs a CUDA device and triton")


@needs_triton
def test_interpreter_matches_torch_path():
    run_interpreted(__file__, f"check_interpreted({CASES!r})")


@needs_triton
def test_interpreter_with_sinks_matches_the_eager_reference():
    run_interpreted(__file__, f"check_interpreted_sinks({SINK_CASES!r})")


@needs_cuda
@pytest.mark.parametrize("case", CUDA_CASES)
def test_cuda_bf16_matches_torch_path(case):
    p = make_problem(case, torch.bfloat16, "cuda")
    got = pa.paged_attention_triton(*p.args(), scale=p.scale, window=p.window)
    assert got.dtype == torch.bfloat16 and got.shape == p.q.shape
    # fp32 math on the same bf16 inputs; the kernel rounds p to bf16 before P @ V, and casts once at the end.
    torch.testing.assert_close(got.float(), expected(p), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, torch_path(p), rtol=3e-2, atol=3e-2)
    assert torch.equal(paged_attention(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span), got)


@needs_cuda
@pytest.mark.parametrize("case", CUDA_CASES)
def test_cuda_bf16_kernel_with_sinks_matches_torch_path(case):
    p = with_padding_query(make_problem(case, torch.bfloat16, "cuda"))
    sinks = make_sinks(p)
    got = pa.paged_attention_triton(*p.args(), scale=p.scale, window=p.window, sinks=sinks)
    assert got.dtype == torch.bfloat16 and got.shape == p.q.shape
    assert torch.equal(got[-1], torch.zeros_like(got[-1]))
    torch.testing.assert_close(got.float(), expected_with_sinks(p, sinks), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, SINK_PATHS["torch"](p, sinks), rtol=3e-2, atol=3e-2)
    assert torch.equal(paged_attention(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span, sinks=sinks),
                       got)


@needs_cuda
@pytest.mark.parametrize("path", ["triton", "torch"])
def test_cuda_graph_replays_new_positions_and_tables(path):
    p = make_problem(CUDA_CASES[1], torch.bfloat16, "cuda")
    run = (lambda: pa.paged_attention_triton(*p.args(), scale=p.scale, window=p.window)) if path == "triton" \
        else (lambda: torch_path(p))
    run()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    # In place, as the engine does between steps: new queries, earlier positions, sequences' blocks moved.
    p.q.copy_(torch.randn_like(p.q))
    p.query_pos.sub_(torch.arange(p.query_pos.shape[0], device="cuda") * 7).clamp_(min=0)
    for s in range(p.block_tables.shape[0]):
        count = -(-p.keys[s].shape[0] // p.k_cache.shape[1])
        old = p.block_tables[s, :count].long()
        new = old[torch.randperm(count, device="cuda")]
        p.k_cache[new], p.v_cache[new] = p.k_cache[old].clone(), p.v_cache[old].clone()
        p.block_tables[s, :count] = new.int()
    graph.replay()
    torch.testing.assert_close(captured, run(), rtol=0, atol=0)
    torch.testing.assert_close(captured.float(), expected(p), rtol=2e-2, atol=2e-2)


@needs_cuda
def test_cuda_latent_attention_heads_wider_than_the_kernel_take_the_torch_path():
    """DeepSeek-V2/V3's cache row: 512 latent + 64 roped dims, one kv head for 16 query heads."""
    p = as_latent(make_problem(([300, 40], [1, 4], 1, 16, 576, 16, None), torch.bfloat16, "cuda"))
    assert not pa.paged_attention_supported(p.q, p.k_cache, p.v_cache)
    got = paged_attention(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span)
    torch.testing.assert_close(got.float(), expected(p), rtol=2e-2, atol=2e-2)


@needs_cuda
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cuda_bf16_prefill_runs_match_the_reference(with_sinks):
    """The split on a GPU: long runs through bf16 SDPA (with sinks, fp32 sink_attention), the rest
    through the kernel."""
    p, runs, others = with_prefill_runs(make_problem(PREFILL_CASE, torch.bfloat16, "cuda"))
    sinks = make_sinks(p) if with_sinks else None
    got = paged_attention(*p.args(), scale=p.scale, window=p.window, max_span=p.max_span, prefill_runs=runs,
                          other_queries=others, sinks=sinks)
    reference = expected(p) if sinks is None else expected_with_sinks(p, sinks)
    torch.testing.assert_close(got.float(), reference, rtol=2e-2, atol=2e-2)
