"""Attention over the paged KV cache: our Triton kernel vs gather + SDPA vs flex_attention (issue G).

One device call (about 90 s on an H100; no case starts after --deadline-s, and the JSON is
rewritten after every case):
    python bench/paged_attention.py --out $OUT/paged_attention.json
CPU smoke run (tiny sizes; torch arms only, add flex with --arms sdpa,flex,reference):
    python bench/paged_attention.py --device cpu --quick --out /tmp/paged_attention.json

Cases, for the Mixtral-8x7B head shape (32 q heads, 8 kv heads, head_dim 128) and the default
model's (moe_serve/models/default/config.json): decode of 1, 8, 32 and 64 sequences at 512 and
2048 keys; decode of 32 sequences of mixed lengths (16..2048: what padding costs); verify spans
(8 sequences x 5 queries) at 512 and 2048; one prefill chunk of 512 queries over 512 and 2048.
Each is one step's queries over a PagedKVCache of the engine's block size (16), its blocks handed
out in a seeded random order (a cache after some churn), its tensors built by StepLayout and
PagedStep as the engine builds them. Every arm reads the same cache and the same queries:
- triton: paged_attention_triton with the arguments the engine's dispatcher passes on a GPU;
- sdpa: per step a padded gather index and a bool position mask; per layer the gather of each
  sequence's blocks into [B, nkv, S, D] and one SDPA over the batch, the g query heads of a kv
  head folded into the query rows ([B, nkv, g*Q, D]: no K/V repeat). Its backend is recorded;
- flex: torch.compile(flex_attention, dynamic=False) over the cache viewed in place as
  [1, nkv, N*block, D] (no gather), with a BlockMask built from the block tables (a mask block is
  a cache block, so key tiles are 16 wide; full blocks skip the mask, partial ones compare the
  key's position in its sequence with the query's). Its first-call compile time is recorded,
  and any error in place of its numbers;
- reference: paged_attention_torch, the correctness oracle (timed eagerly only).
Per-step setup (mask, block mask) is timed apart: an engine builds it once per step for all layers.
The cache has `layers` layers, enough to hold 4x the GPU's L2, and one timed step calls an arm
once per layer, as a forward does, so K/V come from HBM. Per arm: ms per call as the median of
CUDA-event-timed eager steps and of CUDA-graph replays (bench/fused_experts.py's
graph_ms_per_call; the engine replays decode steps), after warm-up; GB/s = the K/V bytes of every
sequence's visible keys, read once, per call; max |out - reference| on layer 0, bf16 on CUDA.
On CPU (fp32) the wall clock times eager steps only.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.nn.attention.flex_attention import BlockMask, flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.fused_experts import graph_ms_per_call  # noqa: E402
from moe_serve.engine.kv.block_manager import blocks_for  # noqa: E402
from moe_serve.engine.kv.paged_attention import (  # noqa: E402
    paged_attention_supported, paged_attention_torch, paged_attention_triton)
from moe_serve.engine.kv.paged_cache import PagedKVCache, PagedStep, StepLayout  # noqa: E402
from moe_serve.engine.models.config import ModelConfig  # noqa: E402
from moe_serve.engine.timing import median_seconds, synchronize  # noqa: E402

ARMS = ("triton", "sdpa", "flex", "reference")
# moe_serve.engine.runtime.KV_BLOCK_SIZE and engine/cli.py's DEFAULT_MODEL, not imported: those modules pull in
# the whole engine (llguidance, transformers, ...), which a bare GPU image lacks
ENGINE_BLOCK_SIZE = 16
DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "moe_serve" / "models" / "default"
FLEX_Q_BLOCK = 128  # query rows per BlockMask row (flex's default)
FLEX_MAX_BLOCK_N = 64  # flex's usual key tile
L2_TARGET_FACTOR = 4  # cache bytes over all layers >= this many L2s, so timed reads come from HBM
MAX_LAYERS = 256


@dataclass(frozen=True)
class HeadShape:
    name: str
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class Case:
    name: str
    context: tuple[int, ...]  # per sequence: its length once this step's tokens are in the cache
    queries: int  # per sequence: its last `queries` positions


def head_shapes() -> list[HeadShape]:
    cfg = ModelConfig.from_hf(json.loads((DEFAULT_MODEL / "config.json").read_text()))
    return [HeadShape("mixtral-8x7b", 32, 8, 128),  # first: the shape the kernel's defaults were tuned on
            HeadShape("default", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)]


def cases(quick: bool) -> list[Case]:
    """Decode at two uniform lengths, decode at mixed lengths (what padding costs), verify spans, prefill chunks."""
    batches, lengths, prefill = ((1, 4), (64,), 32) if quick else ((1, 8, 32, 64), (512, 2048), 512)
    mixed = torch.randint(16, max(lengths) + 1, (4 if quick else 32,), generator=torch.Generator().manual_seed(0))
    out = [Case("decode", (n,) * b, 1) for n in lengths for b in batches]
    out.append(Case("decode-mixed", tuple(mixed.tolist()), 1))
    out += [Case("verify", (n,) * (2 if quick else 8), 5) for n in lengths]
    out += [Case("prefill", (n,), prefill) for n in (prefill, 4 * prefill)]
    return out


class Problem:
    """One step's queries q [T, nq, D] over a `layers`-layer paged cache; step(fn) calls fn(layer) per layer."""

    def __init__(self, shape: HeadShape, case: Case, block_size: int, layers: int, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> None:
        bs = block_size
        counts = [blocks_for(n, bs) for n in case.context]
        order = torch.randperm(sum(counts), generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables = [order[sum(counts[:i]): sum(counts[: i + 1])] for i in range(len(counts))]
        self.cache = PagedKVCache(layers, sum(counts), bs, shape.num_kv_heads, shape.head_dim, device=device,
                                  dtype=dtype)
        gen = torch.Generator(device=device).manual_seed(seed)
        self.cache.keys.normal_(generator=gen)  # [L, N, bs, nkv, D]
        self.cache.values.normal_(generator=gen)
        chunks = [(table, n - case.queries, case.queries) for table, n in zip(self.tables, case.context)]
        self.paged = PagedStep.build(self.cache, StepLayout.of(chunks, bs), device)
        tokens = len(case.context) * case.queries
        self.q = torch.randn(tokens, shape.num_heads, shape.head_dim, generator=gen, device=device).to(dtype)
        self.shape, self.case, self.layers, self.scale = shape, case, layers, shape.head_dim**-0.5
        self.kv_bytes = 2 * sum(case.context) * shape.num_kv_heads * shape.head_dim * self.cache.keys.element_size()

    def step(self, fn: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """One forward's worth of calls: every layer once, back to back (graph_ms_per_call's `problem.step`)."""
        for layer in range(self.layers):
            out = fn(layer)
        return out


def layers_for(shape: HeadShape, case: Case, block_size: int, dtype: torch.dtype, device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)
    per_layer = 2 * sum(blocks_for(n, block_size) * block_size for n in case.context) \
        * shape.num_kv_heads * shape.head_dim * torch.empty((), dtype=dtype).element_size()
    return max(2, min(MAX_LAYERS, math.ceil(L2_TARGET_FACTOR * l2 / per_layer)))


# --- the arms: each builds its per-step state and returns fn(layer) -> [T, nq, D] ---------------

def triton_arm(p: Problem) -> Callable[[int], torch.Tensor]:
    keys, values, s = p.cache.keys, p.cache.values, p.paged
    if not paged_attention_supported(p.q, keys[0], values[0]):
        raise RuntimeError("paged_attention_supported() is False: the Triton kernel needs CUDA, triton and a "
                           "supported dtype")
    return lambda layer: paged_attention_triton(p.q, keys[layer], values[layer], s.block_tables, s.query_seq,
                                                s.positions, scale=p.scale, window=None)


def reference_arm(p: Problem) -> Callable[[int], torch.Tensor]:
    keys, values, s = p.cache.keys, p.cache.values, p.paged
    return lambda layer: paged_attention_torch(p.q, keys[layer], values[layer], s.block_tables, s.query_seq,
                                               s.positions, scale=p.scale, window=None, max_span=s.max_span)


def sdpa_setup(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
    """Per step: the gather index [B, nb] (padded to the longest sequence) and the mask [B, 1, g*Q, S]."""
    b, queries, g = len(p.case.context), p.case.queries, p.shape.num_heads // p.shape.num_kv_heads
    nb = blocks_for(p.paged.max_span, p.cache.block_size)
    tables = p.paged.block_tables[:, :nb].long()  # [B, nb]; padding entries point at block 0, masked below
    key_pos = torch.arange(nb * p.cache.block_size, device=p.q.device)  # [S]
    row_pos = p.paged.positions.view(b, queries).repeat(1, g)  # [B, g*Q]: row r is query r % Q
    return tables, key_pos[None, None, None, :] <= row_pos[:, None, :, None]  # [B, 1, g*Q, S]


def sdpa_arm(p: Problem) -> tuple[Callable[[int], torch.Tensor], dict]:
    b, queries = len(p.case.context), p.case.queries
    nq, nkv, d = p.shape.num_heads, p.shape.num_kv_heads, p.shape.head_dim
    tables, allowed = sdpa_setup(p)
    span = tables.shape[1] * p.cache.block_size

    def attend(layer: int) -> torch.Tensor:
        k = p.cache.keys[layer][tables].view(b, span, nkv, d).transpose(1, 2)  # [B, nkv, S, D]
        v = p.cache.values[layer][tables].view(b, span, nkv, d).transpose(1, 2)  # [B, nkv, S, D]
        q = p.q.view(b, queries, nkv, nq // nkv, d).permute(0, 2, 3, 1, 4).reshape(b, nkv, -1, d)  # [B, nkv, g*Q, D]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=p.scale)  # [B, nkv, g*Q, D]
        return out.view(b, nkv, nq // nkv, queries, d).permute(0, 3, 1, 2, 4).reshape(b * queries, nq, d)

    info = {"backend": sdpa_backend(p, tables, allowed), "mask": "bool [B, 1, g*Q, S]",
            "padded_keys_per_sequence": span}
    return attend, info


def sdpa_backend(p: Problem, tables: torch.Tensor, allowed: torch.Tensor) -> str:
    """The backend SDPA's dispatcher picks for these inputs (torch._fused_sdp_choice, private)."""
    b, nkv, d = tables.shape[0], p.shape.num_kv_heads, p.shape.head_dim
    k = p.cache.keys[0][tables].view(b, -1, nkv, d).transpose(1, 2)  # [B, nkv, S, D]
    q = p.q.view(b, p.case.queries, nkv, -1, d).permute(0, 2, 3, 1, 4).reshape(b, nkv, -1, d)
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, k, allowed, 0.0, False, scale=p.scale)).name
    except Exception as error:  # private API: report, don't fail the arm
        return f"unknown ({type(error).__name__}: {error})"


def flex_block_mask(p: Problem):
    """BlockMask over the in-place cache [1, nkv, N*bs, D]: mask block (q tile, cache block), per sequence b.

    Blocks entirely at or before a q tile's first position are full (no mask_mod); the rest up to its
    last position are partial: the key's position in its sequence (from the block tables) <= the query's.
    """
    b, queries, bs = len(p.case.context), p.case.queries, p.cache.block_size
    n, device = p.cache.num_blocks, p.q.device
    logical = torch.full((n, bs), 1 << 30, dtype=torch.long)  # [N, bs]: each slot's position in its sequence
    for table in p.tables:
        logical[table] = torch.arange(len(table) * bs).view(-1, bs)
    logical = logical.view(-1).to(device)  # [N*bs]
    pos = p.paged.positions.view(b, queries)  # [B, Q], ascending within a sequence
    firsts = list(range(0, queries, FLEX_Q_BLOCK))
    lasts = [min(queries, f + FLEX_Q_BLOCK) - 1 for f in firsts]
    full = (pos[:, firsts] + 1) // bs  # [B, nqb] blocks every query of the tile sees whole
    partial = pos[:, lasts] // bs + 1 - full  # [B, nqb]
    tables = p.paged.block_tables.long()  # [B, W]
    cols = torch.arange(n, device=device)  # indices are [B, 1, nqb, N]: flex wants one slot per kv block
    full_idx = tables[:, cols.clamp(max=tables.shape[1] - 1)][:, None, None, :].expand(-1, 1, len(firsts), -1)
    part_cols = (full[..., None] + cols).clamp(max=tables.shape[1] - 1)  # [B, nqb, N]
    part_idx = torch.gather(tables[:, None, :].expand(-1, len(firsts), -1), 2, part_cols)[:, None]

    def mask_mod(b_idx, h_idx, q_idx, kv_idx):
        return logical[kv_idx] <= pos[b_idx, q_idx]

    as_int = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    return BlockMask.from_kv_blocks(as_int(partial[:, None]), as_int(part_idx), as_int(full[:, None]),
                                    as_int(full_idx), BLOCK_SIZE=(FLEX_Q_BLOCK, bs), mask_mod=mask_mod,
                                    seq_lengths=(queries, n * bs), compute_q_blocks=False)


def flex_arm(p: Problem, flex: Callable) -> tuple[Callable[[int], torch.Tensor], dict]:
    b, queries = len(p.case.context), p.case.queries
    nq, nkv, d = p.shape.num_heads, p.shape.num_kv_heads, p.shape.head_dim
    block_mask = flex_block_mask(p)
    in_place = lambda t: t.view(1, -1, nkv, d).transpose(1, 2)  # noqa: E731  [N, bs, nkv, D] -> [1, nkv, N*bs, D]
    # A key tile must not cross a cache block: flex's kernels require BLOCK_N | the mask's kv block (its
    # decoding kernel clamps BLOCK_N itself, the main one, which serves Q >= 128, raises instead)
    options = {"BLOCK_N": min(FLEX_MAX_BLOCK_N, p.cache.block_size)}

    def attend(layer: int) -> torch.Tensor:
        q = p.q.view(b, queries, nq, d).transpose(1, 2)  # [B, nq, Q, D]
        out = flex(q, in_place(p.cache.keys[layer]), in_place(p.cache.values[layer]), block_mask=block_mask,
                   scale=p.scale, enable_gqa=True, kernel_options=options)  # [B, nq, Q, D]
        return out.transpose(1, 2).reshape(b * queries, nq, d)

    started = time.perf_counter()
    attend(0)  # compiles for this shape
    synchronize(p.q.device)
    return attend, {"compile_s": time.perf_counter() - started, "q_block": FLEX_Q_BLOCK,
                    "kv_block": p.cache.block_size, "kernel_options": options}


# --- timing -------------------------------------------------------------------------------------

def eager_ms_per_call(p: Problem, fn: Callable[[int], torch.Tensor], seconds: float) -> tuple[float, int]:
    """Median over repeats of one eager step (every layer once), per call; as many repeats as fit `seconds`."""
    device = p.q.device
    p.step(fn)  # warm-up: compile, allocator
    synchronize(device)
    started = time.perf_counter()
    p.step(fn)
    synchronize(device)
    repeats = max(3, min(50, int(seconds / (time.perf_counter() - started))))
    if device.type != "cuda":
        return median_seconds(lambda: p.step(fn), device, repeats) * 1e3 / p.layers, repeats
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        p.step(fn)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times) / p.layers, repeats


def measure(p: Problem, build: Callable[[], object], setup: Callable[[], object] | None,
            ref: torch.Tensor | None, seconds: float, graphs: bool) -> dict:
    """One arm on one problem: per-step setup time, eager and graph ms per call, GB/s, max |diff| vs reference."""
    result: dict = {}
    try:
        built = build()
        fn, info = built if isinstance(built, tuple) else (built, {})
        result.update(info)
        if setup is not None:
            result["setup_ms"] = median_seconds(setup, p.q.device, repeats=3) * 1e3
        if ref is not None:
            result["max_abs_diff"] = (fn(0).float() - ref).abs().max().item()
        result["eager_ms"], result["eager_repeats"] = eager_ms_per_call(p, fn, seconds)
        result["eager_gbps"] = p.kv_bytes / result["eager_ms"] / 1e6
    except Exception as error:  # an arm that cannot run here is a result, not a crash
        result["error"] = f"{type(error).__name__}: {error}"[:2000]
        return result
    if graphs:
        try:
            result["graph_ms"] = graph_ms_per_call(p, fn, p.layers, replays=30)
            result["graph_gbps"] = p.kv_bytes / result["graph_ms"] / 1e6
        except Exception as error:  # capture can fail where eager runs: keep the eager numbers
            result["graph_error"] = f"{type(error).__name__}: {error}"[:2000]
    return result


def row(shape: HeadShape, case: Case, arms: list[str], block_size: int, dtype: torch.dtype, device: torch.device,
        seconds: float, flex: Callable) -> dict:
    p = Problem(shape, case, block_size, layers_for(shape, case, block_size, dtype, device), dtype, device)
    ref = paged_attention_torch(p.q, p.cache.keys[0], p.cache.values[0], p.paged.block_tables, p.paged.query_seq,
                                p.paged.positions, scale=p.scale, window=None, max_span=p.paged.max_span).float()
    builders = {"triton": lambda: triton_arm(p), "sdpa": lambda: sdpa_arm(p), "flex": lambda: flex_arm(p, flex),
                "reference": lambda: reference_arm(p)}
    setups = {"sdpa": lambda: sdpa_setup(p), "flex": lambda: flex_block_mask(p)}  # what a step builds for all layers
    graphs = device.type == "cuda"
    result = {"shape": asdict(shape), "case": case.name, "sequences": len(case.context),
              "queries_per_sequence": case.queries, "context_min": min(case.context),
              "context_mean": statistics.mean(case.context), "context_max": max(case.context),
              "kv_bytes_per_call": p.kv_bytes, "layers": p.layers, "arms": {}}
    for name in arms:  # the reference is the oracle: timed eagerly only
        result["arms"][name] = measure(p, builders[name], setups.get(name), None if name == "reference" else ref,
                                       seconds, graphs and name != "reference")
    return result


# --- report -------------------------------------------------------------------------------------

def cell(arm: dict, key: str) -> str:
    if key not in arm:
        return "error" if "error" in arm or key == "graph_ms" and "graph_error" in arm else "-"
    gbps = arm[key.replace("_ms", "_gbps")]
    return f"{arm[key]:.4f} ({gbps:.0f})" if gbps >= 10 else f"{arm[key]:.4f} ({gbps:.2f})"


def markdown(rows: list[dict], arms: list[str], key: str) -> str:
    """ms per call (GB/s) per arm, and each arm's max |diff| vs the reference."""
    head = "| shape | case | B x Q | context | KV MB | " + " | ".join(f"{a} ms (GB/s)" for a in arms) + \
        " | max abs diff vs reference |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        ctx = str(r["context_max"]) if r["context_min"] == r["context_max"] else \
            f"{r['context_min']}-{r['context_max']}"
        diffs = ", ".join(f"{a} {r['arms'][a]['max_abs_diff']:.1e}" for a in arms
                          if "max_abs_diff" in r["arms"][a])
        lines.append(f"| {r['shape']['name']} | {r['case']} | {r['sequences']} x {r['queries_per_sequence']} | "
                     f"{ctx} | {r['kv_bytes_per_call'] / 1e6:.1f} | "
                     + " | ".join(cell(r["arms"][a], key) for a in arms) + f" | {diffs} |")
    return "\n".join(lines)


def report(result: dict, arms: list[str]) -> str:
    parts = []
    for key, title in (("graph_ms", "CUDA-graph replays"), ("eager_ms", "eager steps")):
        if any(key in r["arms"][a] for r in result["rows"] for a in arms):
            parts.append(f"ms per call, {title}, on {result['device']}:\n\n" + markdown(result["rows"], arms, key))
    notes = [f"- {a} backend: {', '.join(backends)}" for a in arms
             if (backends := sorted({r["arms"][a]["backend"] for r in result["rows"] if "backend" in r["arms"][a]}))]
    errors: dict[str, list[str]] = {}  # message -> the cases it ended
    for r in result["rows"]:
        for a in arms:
            for kind in ("error", "graph_error"):
                if kind in r["arms"][a]:
                    message = f"{a} {kind.replace('_', ' ')}: {r['arms'][a][kind].splitlines()[0][:300]}"
                    errors.setdefault(message, []).append(f"{r['shape']['name']} {r['case']} {r['sequences']}")
    notes += [f"- {message} ({len(where)} cases, first {where[0]})" for message, where in errors.items()]
    notes += [f"- skipped past --deadline-s: {case}" for case in result["skipped_past_deadline"]]
    return "\n\n".join(parts + ["\n".join(notes)] if notes else parts)


def print_row(r: dict, arms: list[str]) -> None:
    keep = ("eager_ms", "graph_ms", "max_abs_diff", "compile_s", "error", "graph_error")
    print(json.dumps({"shape": r["shape"]["name"], "case": r["case"], "B": r["sequences"], "ctx": r["context_max"],
                      **{a: {k: float(f"{v:.4g}") if isinstance(v, float) else v[:200] if isinstance(v, str) else v
                             for k, v in r["arms"][a].items() if k in keep} for a in arms}}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON path (the table is printed)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, for a CPU smoke run")
    parser.add_argument("--arms", help=f"comma-separated of {','.join(ARMS)}; default all on CUDA, "
                        "sdpa,reference on CPU (flex compiles through inductor's C++ backend there: seconds a case)")
    parser.add_argument("--shapes", default="mixtral-8x7b,default")
    parser.add_argument("--block-size", type=int, default=ENGINE_BLOCK_SIZE, help="token positions per KV block")
    parser.add_argument("--deadline-s", type=float, default=75, help="no new case after this many seconds")
    parser.add_argument("--seconds", type=float, help="eager timing budget per case and arm (0.2; 0.02 with --quick)")
    parser.add_argument("--cpu-threads", type=int, default=1,
                        help="torch threads on CPU: one keeps a smoke run on shared cores from stalling")
    args = parser.parse_args()
    device = torch.device(args.device)
    seconds = args.seconds or (0.02 if args.quick else 0.2)
    if device.type == "cpu":
        torch.set_num_threads(args.cpu_threads)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    arms = (args.arms or ("triton,sdpa,flex,reference" if device.type == "cuda" else "sdpa,reference")).split(",")
    if unknown := set(arms) - set(ARMS):
        parser.error(f"unknown arms {sorted(unknown)}; choose from {ARMS}")
    shapes = [s for s in head_shapes() if s.name in args.shapes.split(",")]
    limit = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    setattr(torch._dynamo.config, limit, 256)  # flex compiles once per case (dynamic=False: static kernels)
    flex = torch.compile(flex_attention, dynamic=False)
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    result = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu", "torch": torch.__version__, "triton": triton_version, "cuda": torch.version.cuda,
              "dtype": str(dtype), "block_size": args.block_size, "arms": arms, "rows": [],
              "skipped_past_deadline": []}
    started = time.perf_counter()
    for shape in shapes:
        for case in cases(args.quick):
            if time.perf_counter() - started > args.deadline_s:
                result["skipped_past_deadline"].append(f"{shape.name} {case.name} {len(case.context)} x {case.queries} "
                                                       f"ctx {max(case.context)}")
                continue
            result["rows"].append(row(shape, case, arms, args.block_size, dtype, device, seconds, flex))
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the last case's cache layers, before the next one's
            print_row(result["rows"][-1], arms)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=2))  # after every row: a timeout keeps the rest
    result["wall_s"] = time.perf_counter() - started
    result["table"] = report(result, arms)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(result["table"])


if __name__ == "__main__":
    main()
