"""What constrained decoding costs per token: the grammar masks alone, then whole engine steps.

    python bench/structured_mask.py --device cuda --out $OUT/structured_mask.json
    python bench/structured_mask.py --model DIR --vocab 152064 --batch 1 32

mask: B matchers of one JSON schema walk random allowed paths (a grammar restarts once complete),
through the engine's own MaskFiller and grammar process. Per step it times, all on the engine
thread: sending the step (or taking the follow job's), its masks (the wait for the grammar process,
which consumes the last tokens and fills the rows, with nothing to overlap here; the copy into the
pinned rows and the checks), the sampler with and without the masks (on CUDA one kernel either way,
race.py; on a CPU the torch ops; the two in alternating order, since the first sampler call after a
fill runs slower on a CPU), and handing the tokens back (MaskFiller.follow: one message).
overhead_us_per_step is their sum: what a step pays for its masks when nothing overlaps them.
--vocab pads the logits (and mask) width to a real model's, since the embedded default model's
tokenizer has only 8192 tokens. engine: B requests through EngineCore on --model, constrained to a fixed-length
JSON array vs unconstrained, same tokens each, in alternating rounds; the median step time while
all B run, per token, and the median of the rounds' ratios. The issue's bar: constrained TPOT
within 10% of unconstrained.
"""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the schema, the synthetic tokenizer and the report's output are shared with grammar_engines.py (llguidance vs xgrammar)
from bench.grammar_engines import SCHEMA, print_and_save, synthetic_tokenizer  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.core import EngineCore  # noqa: E402
from moe_serve.engine.messages import GenerateRequest, SamplingParams, StructuredOutput  # noqa: E402
from moe_serve.engine.sampler import SamplingBatch, SamplingRow, sample  # noqa: E402
from moe_serve.engine.structured import Grammars, MaskFiller  # noqa: E402

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "moe_serve" / "models" / "default"
ARRAY_ITEMS = 48  # the engine run's schema: exactly this many one-digit integers, ~2 tokens each
# constrained and unconstrained runs alternate, each round giving one ratio: a host's drift between
# two long runs moved the ratio more than the masks cost
ENGINE_ROUNDS = 6


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allowed_ids(bits: torch.Tensor) -> list[int]:
    """The token ids a [W] int32 mask row allows."""
    unpacked = (bits[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return unpacked.flatten().nonzero().flatten().tolist()


def bench_masks(grammars: Grammars, batch: int, steps: int, device: torch.device, vocab: int) -> dict:
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA))
    filler, rng = MaskFiller(), random.Random(0)
    matchers = [grammars.matcher(structured) for _ in range(batch)]
    rows = [SamplingRow(SamplingParams(max_tokens=10**6, temperature=1.0, seed=i), i, ()) for i in range(batch)]
    logits = torch.randn(batch, vocab, device=device)
    sampling = SamplingBatch.build(rows, device)
    start, fill, masked, plain, follow = [], [], [], [], []
    for step in range(steps + 1):  # step 0 warms up (the process started, first calls, allocations): not timed
        sync(device)
        t0 = time.perf_counter()
        pending = filler.pending(matchers, device)
        t1 = time.perf_counter()
        mask = pending.result()
        t2 = time.perf_counter()
        arms, sampler_s = [("masked", lambda: mask), ("plain", None)], {}
        for arm, allowed in arms if step % 2 else arms[::-1]:  # either runs first after the fill, in turn
            started = time.perf_counter()
            sample(logits, sampling, allowed).to_host()
            sampler_s[arm] = time.perf_counter() - started
        host_bits = mask.bits.cpu()
        chosen = [rng.choice(allowed_ids(host_bits[k])) for k in range(batch)]  # a random allowed path
        t3 = time.perf_counter()
        filler.follow(pending, chosen)  # as the engine hands a step's tokens back
        t4 = time.perf_counter()
        if any(grammar.complete_at is not None for grammar in matchers):  # complete: start the next document
            matchers = [grammars.matcher(structured) if grammar.complete_at is not None else grammar
                        for grammar in matchers]
        if step == 0:
            continue
        start.append(t1 - t0)
        fill.append(t2 - t0)
        masked.append(sampler_s["masked"])
        plain.append(sampler_s["plain"])
        follow.append(t4 - t3)
    grammars.close()
    us = 1e6
    med = statistics.median
    apply = med(masked) - med(plain)
    return {"batch": batch, "steps": steps, "vocab": vocab,
            "start_us_per_step": med(start) * us,
            "fill_us_per_step": med(fill) * us, "fill_us_per_row": med(fill) * us / batch,
            "sample_masked_us": med(masked) * us, "sample_plain_us": med(plain) * us, "mask_apply_us": apply * us,
            "follow_us_per_step": med(follow) * us,
            "overhead_us_per_step": (med(fill) + apply + med(follow)) * us}


def bench_engine(model: str, device: str, batch: int) -> dict:
    array = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
             "minItems": ARRAY_ITEMS, "maxItems": ARRAY_ITEMS}
    constrained = StructuredOutput("json_schema", json.dumps(array))
    core = EngineCore(EngineConfig(model=model, device=device))
    try:
        # a first pair warms up (kernels compiled, graphs captured, the tokenizer wrapped) and
        # counts the array's tokens, which every unconstrained run then generates too
        _, tokens = run_batch(core, batch, constrained, 8 * ARRAY_ITEMS)  # ends when the array closes
        run_batch(core, batch, None, 16)
        arms = [(constrained, 8 * ARRAY_ITEMS), (None, tokens)]
        rounds = []
        for r in range(ENGINE_ROUNDS):  # the order alternates: neither side always runs first
            runs = {structured: run_batch(core, batch, structured, limit)[0]
                    for structured, limit in (arms if r % 2 == 0 else arms[::-1])}
            rounds.append((runs[constrained], runs[None]))
    finally:
        core.close()
    with_mask, without = [t for r in rounds for t in r[0]], [t for r in rounds for t in r[1]]
    tpot, plain = statistics.median(with_mask), statistics.median(without)
    ratios = [statistics.median(c) / statistics.median(u) for c, u in rounds]
    return {"batch": batch, "tokens": tokens, "steps_timed": [len(with_mask), len(without)],
            "tpot_constrained_s": tpot, "tpot_unconstrained_s": plain, "ratio": statistics.median(ratios),
            "round_ratios": ratios}


def run_batch(core: EngineCore, batch: int, structured: StructuredOutput | None,
              max_tokens: int) -> tuple[list[float], int]:
    """Step B requests to the end: the seconds of each step in which all B decoded a token, and
    the tokens the first request produced."""
    for i in range(batch):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, structured=structured)
        assert core.add_request(GenerateRequest(f"r{i}", (1, 2, 3, 4), params)) is None
    times, produced = [], 0
    while core.has_unfinished():
        decoding = sum(1 for seq in core.scheduler.running if seq.output_ids)
        started = time.perf_counter()
        outputs = core.step()
        elapsed = time.perf_counter() - started
        if decoding == batch and len(outputs) == batch:
            times.append(elapsed)
        produced += sum(len(o.new_token_ids) for o in outputs if o.request_id == "r0")
    return times, produced


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint dir (tokenizer + engine run)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=200, help="mask steps per batch size")
    parser.add_argument("--vocab", type=int, default=None, help="logits width (default: the tokenizer's)")
    parser.add_argument("--synthetic-vocab", type=int, default=None,
                        help="masks: a BPE of about this many tokens trained on the stdlib instead of --model's")
    parser.add_argument("--no-engine", action="store_true", help="masks only")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    from transformers import AutoTokenizer

    hf = synthetic_tokenizer(args.synthetic_vocab) if args.synthetic_vocab else \
        AutoTokenizer.from_pretrained(args.model)
    vocab = max(args.vocab or 0, len(hf))
    grammars = Grammars(lambda: hf, vocab)
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch_threads": torch.get_num_threads(), "model": args.model, "tokenizer_vocab": len(hf),
              "llguidance": metadata.version("llguidance"),
              "mask": [bench_masks(grammars, b, args.steps, device, vocab) for b in args.batch]}
    if not args.no_engine:
        result["engine"] = [bench_engine(args.model, args.device, b) for b in args.batch]
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
