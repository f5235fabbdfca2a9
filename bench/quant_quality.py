"""Quality of the quantized expert formats (issue H): held-out perplexity and greedy agreement.

    python bench/quant_quality.py --out bench/results/quant
    python bench/quant_quality.py --tokens 4092 --files 4 --new-tokens 16 --out /tmp/quant

Everything runs through the engine's own model: one Runtime per `--expert-quant` format
(build_runtime(EngineConfig(expert_quant=...)), what EngineCore and the server build), so the
experts are encoded at load, kept quantized in the store and the expert slots, and decoded by the
format's own code in the expert compute (on the CPU the reference dequantization, on the GPU the
Triton kernels). Every other weight, and the arithmetic, is fp32 on the CPU (the engine's CPU
dtype), bf16 on the GPU. Both measurements use the runtime's one-sequence path (Runtime.target, a
BoundModel over a contiguous KV cache, and PlainDecoder: the path speculative decoding and the
benchmarks' references run). The batched scheduler path shares the model and the expert
runner but on the CPU attends through a gather reference that costs ~30 s per 1024-token
prefill on two cores; tests/bench/test_quant_quality.py checks that it gives the same logprobs
and greedy tokens on short inputs.

1. Perplexity. The default model's held-out split (scripts/stdlib_corpus.py, the training
   script's) as scripts/measure_default_model.py reads it: every held-out file's tokens followed
   by end-of-text, in corpus order, as one stream; its first --tokens tokens cut into
   non-overlapping windows of --seq-len (the defaults, 64 x 1024, are that script's windows).
   Each window is one prefill; perplexity = exp(mean NLL) of its tokens 1... The same tokens
   for every format. The argmax of each position also gives the teacher-forced top-1
   agreement: the share of positions whose most likely next token equals format none's.
2. Greedy agreement. --files held-out prompts of --prompt-len tokens (bench/prompts.py: one per
   file, a third of the way in), each continued greedily for --new-tokens with EOS ignored,
   every format decoding freely (no teacher). Against format none: the share of continuations
   identical token for token, the mean length of the matching prefix, and the share of
   positions holding the same token.

Writes quant_quality.json (every number, settings, versions) and quant_quality.md (the table).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.prompts import CORPUS, corpus, heldout_prompts  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.decode import PlainDecoder  # noqa: E402
from moe_serve.engine.experts.formats import EXPERT_QUANT_NAMES  # noqa: E402
from moe_serve.engine.messages import GenerateRequest, SamplingParams  # noqa: E402
from moe_serve.engine.runtime import Runtime, build_runtime  # noqa: E402
from moe_serve.engine.sequence import Sequence  # noqa: E402

DEFAULT_MODEL = REPO / "moe_serve" / "models" / "default"
GOALS = {"int8": 0.01, "int4": 0.05, "q4_k": 0.05, "q4_k_m": 0.05}  # issue H: perplexity at most this far above bf16
GGUF_NOTE = ("GGUF formats are quantized at load by the engine's own encoders: for q8_0, q4_0, q4_1, q5_0 and q5_1 "
             "these are llama.cpp's reference quantizers, bit for bit (the tests hold them to the gguf package's), "
             "so the rows are what llama-quantize writes without an importance matrix; the k-quants (q2_k to "
             "q6_k, and the mixes q4_k_m / q5_k_m, which give the down projection of llama.cpp's sensitive layers "
             "Q6_K as its Q4_K_M / Q5_K_M do) and iq4_nl / iq4_xs use a plain round-to-nearest, not llama.cpp's "
             "scale search, so a file from llama-quantize can be a little more accurate. 'expert bytes' of a mix "
             "is the mean over layers.")


def heldout_windows(tokenizer_dir: Path, tokens: int, seq_len: int, corpus_path: Path = CORPUS) -> list[list[int]]:
    """The first tokens // seq_len non-overlapping windows of the held-out token stream (each file's
    tokens + end-of-text, corpus order: scripts/measure_default_model.py's stream)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    count = tokens // seq_len
    stream: list[int] = []
    for doc in corpus.split(corpus.read_corpus(corpus_path), "heldout"):
        stream += tokenizer(doc.text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        if len(stream) >= count * seq_len:
            return [stream[i * seq_len:(i + 1) * seq_len] for i in range(count)]
    raise ValueError(f"the held-out split has {len(stream)} tokens, fewer than {count} x {seq_len}")


def score_windows(runtime: Runtime, windows: list[list[int]]) -> dict:
    """Per window, the logprob of each of its tokens 1.. and the argmax id of the position before it."""
    logprobs: list[float] = []
    argmax: list[int] = []
    for window in windows:
        runtime.target.reset()
        logp = torch.log_softmax(runtime.target.forward(window)[:-1], dim=-1)  # [T - 1, V] fp32
        runtime.finish_step()
        targets = torch.tensor(window[1:])[:, None]  # [T - 1, 1]
        logprobs += logp.gather(1, targets).squeeze(1).tolist()
        argmax += logp.argmax(dim=-1).tolist()
    return {"logprobs": logprobs, "argmax": argmax}


def greedy(runtime: Runtime, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt continued greedily for new_tokens (no stop tokens: EOS ignored)."""
    decoder = PlainDecoder(runtime.target)
    continuations = []
    for i, prompt in enumerate(prompts):
        decoder.reset()
        seq = Sequence.from_request(GenerateRequest(f"greedy-{i}", tuple(prompt),
                                                    SamplingParams(max_tokens=new_tokens, temperature=0.0)))
        while seq.finish_reason is None:
            decoder.step(seq, runtime.max_model_len)
            runtime.finish_step()
        continuations.append(list(seq.output_ids))
    return continuations


def matching_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def agreement(reference: list[list[int]], got: list[list[int]]) -> dict:
    """Free-running greedy continuations against the reference format's, prompt by prompt."""
    prefixes = [matching_prefix(r, g) for r, g in zip(reference, got)]
    same = sum(x == y for r, g in zip(reference, got) for x, y in zip(r, g))
    positions = sum(len(r) for r in reference)
    return {"identical_share": sum(r == g for r, g in zip(reference, got)) / len(reference),
            "mean_matching_prefix": sum(prefixes) / len(prefixes),
            "token_agreement": same / positions,
            "first_divergence": [p if p < len(r) else None for p, r in zip(prefixes, reference)]}


def measure_format(args: argparse.Namespace, quant: str, windows: list[list[int]],
                   prompts: list[list[int]]) -> dict:
    started = time.perf_counter()
    runtime = build_runtime(EngineConfig(model=args.model, device=args.device, expert_quant=quant))
    try:
        settings = runtime.describe()
        with torch.inference_mode():
            scores = score_windows(runtime, windows)
            continuations = greedy(runtime, prompts, args.new_tokens)
    finally:
        runtime.close()
    nll = -sum(scores["logprobs"]) / len(scores["logprobs"])
    layouts = runtime.runner.store.layouts
    return {"expert_quant": quant, "expert_format": settings["expert_format"],
            "expert_bytes": round(sum(layout.nbytes for layout in layouts) / len(layouts)),  # a mix's differ by layer
            "perplexity": math.exp(nll), "nll_per_token": nll, "scored_tokens": len(scores["logprobs"]),
            "seconds": time.perf_counter() - started, "_argmax": scores["argmax"], "_continuations": continuations}


def compare(rows: list[dict]) -> None:
    """Each row against the first (format none): perplexity ratio, goals, argmax and greedy agreement."""
    base = rows[0]
    for row in rows:
        row["perplexity_vs_none"] = row["perplexity"] / base["perplexity"] - 1
        goal = GOALS.get(row["expert_quant"])
        row["goal"] = None if goal is None else {"max_increase": goal, "met": row["perplexity_vs_none"] <= goal}
        pairs = list(zip(base["_argmax"], row["_argmax"]))
        row["teacher_forced_top1_agreement"] = sum(a == b for a, b in pairs) / len(pairs)
        row["greedy"] = agreement(base["_continuations"], row["_continuations"])
    for row in rows:
        row["continuations"] = row.pop("_continuations")
        del row["_argmax"]


def _pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [f"# {report['title']}", "", f"Command: `{report['command']}`", "",
             f"Device: {report['device']}; {report['versions']}", "",
             f"Perplexity over {s['windows']} held-out windows x {s['seq_len']} tokens "
             f"({report['rows'][0]['scored_tokens']} scored); greedy agreement over {s['files']} held-out prompts "
             f"x {s['prompt_len']} tokens, "
             f"{s['new_tokens']} new tokens each, every format decoding freely, against format none.", "",
             "| --expert-quant | expert bytes | perplexity | vs none | goal | teacher-forced top-1 = none | "
             "identical continuations | mean matching prefix | token agreement |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["rows"]:
        goal = "–" if r["goal"] is None else (f"<= {100 * r['goal']['max_increase']:.0f}%: "
                                              f"{'met' if r['goal']['met'] else 'missed'}")
        g = r["greedy"]
        lines.append(f"| {r['expert_format']} | {r['expert_bytes']:,} | {r['perplexity']:.4f} | "
                     f"{_pct(r['perplexity_vs_none'])} | {goal} | {100 * r['teacher_forced_top1_agreement']:.2f}% | "
                     f"{100 * g['identical_share']:.1f}% | {g['mean_matching_prefix']:.1f} / {s['new_tokens']} | "
                     f"{100 * g['token_agreement']:.1f}% |")
    lines += [""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint dir (tokenizer + engine)")
    parser.add_argument("--corpus", default=str(CORPUS), help="the stdlib corpus the model was trained from")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--formats", default=",".join(EXPERT_QUANT_NAMES), help="comma-separated, none first")
    parser.add_argument("--tokens", type=int, default=64 * 1024, help="held-out tokens in perplexity windows")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per perplexity window")
    parser.add_argument("--files", type=int, default=64, help="held-out files, one greedy prompt each")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", required=True, help="folder for quant_quality.json and .md")
    parser.add_argument("--stem", default="quant_quality")
    args = parser.parse_args(argv)
    formats = args.formats.split(",")
    if formats[0] != "none":
        parser.error("--formats must start with none: the others are compared with it")
    torch.manual_seed(0)
    windows = heldout_windows(Path(args.model), args.tokens, args.seq_len, Path(args.corpus))
    prompts = heldout_prompts(args.model, args.files, args.prompt_len, Path(args.corpus))
    rows = []
    for quant in formats:
        rows.append(measure_format(args, quant, windows, prompts))
        print(f"{quant}: perplexity {rows[-1]['perplexity']:.4f} ({rows[-1]['seconds']:.0f} s)", file=sys.stderr)
    compare(rows)
    if args.device.startswith("cuda"):
        device = torch.cuda.get_device_name(args.device)
    else:
        device = f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    report = {
        "title": "Quantized experts: held-out perplexity and greedy agreement (default model)",
        "command": "python bench/quant_quality.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "device": device,
        "versions": f"torch {torch.__version__}, Python {platform.python_version()}",
        "compute_dtype": "fp32" if args.device == "cpu" else "bf16",
        "settings": {"model": args.model, "corpus": args.corpus, "windows": len(windows), "seq_len": args.seq_len,
                     "files": len(prompts), "prompt_len": args.prompt_len, "new_tokens": args.new_tokens},
        "rows": rows,
        "notes": [
            "Format none is the checkpoint's bf16 experts computed in the engine's compute dtype "
            f"({'fp32 on the CPU' if args.device == 'cpu' else 'bf16'}); the quantized formats are encoded "
            "from the same bf16 weights at load and decoded by the engine's own expert path.",
            "Only the routed experts are quantized; attention, router, embeddings and norms keep the compute dtype.",
            "'expert bytes' is one expert's packed row (gate, up, down and scales) as the store holds it: format "
            "none keeps the compute dtype, so on the CPU its row is fp32, twice the checkpoint's bf16 bytes.",
            "Perplexity: exp(mean NLL) of tokens 1.. of each window, one prefill per window through Runtime.target "
            "(the engine's model and expert runner over a one-sequence KV cache); "
            "'teacher-forced top-1 = none': share of those positions whose most likely next token equals "
            "format none's.",
            "Greedy: every format continues the same prompts freely; 'identical' = whole continuation equal to none's, "
            "'mean matching prefix' = tokens before the first difference, 'token agreement' = positions holding "
            "the same token (after a divergence the contexts differ, so this counts coincidences too).",
            GGUF_NOTE,
        ],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{args.stem}.md").write_text(markdown(report))
    print(markdown(report))
    return report


if __name__ == "__main__":
    main()
