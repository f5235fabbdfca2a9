"""llguidance vs xgrammar on the CPU: one JSON schema's token masks, the same walks through both.

    /tmp/xg/bin/python bench/grammar_engines.py --out bench/results/structured/grammar_engines-cpu.json
    /tmp/xg/bin/python bench/grammar_engines.py --synthetic-vocab 151936 --out $OUT/grammar_engines-cpu-152k.json

xgrammar is not a dependency of this project (it requires torch and, on Linux x86-64, Triton), so
run this from a throwaway venv that has both engines; it imports nothing from moe_serve:

    python3 -m venv /tmp/xg && /tmp/xg/bin/pip install torch==2.13.0 xgrammar transformers tokenizers llguidance

B rows walk SCHEMA (shared with bench/structured_mask.py). Each step both engines fill the B rows'
masks, then every row takes one token that BOTH masks allow and both engines consume it, so they
walk the same text. Two walks: "random", a token drawn at random from the common set (EOS left out),
as structured_mask.py walks (its documents tend to stay in one long number); "documents", the
tokenizer's own tokens of random valid documents with the kind of values a model writes (mostly
inside strings, where masks are wide). A row whose token is not in the common set (its document
done, or the engines disagree: counted, with the engine that refused) starts a new document.

Per step it times four fills, each with matchers of its own (llguidance keeps a state's mask once
computed, so a second fill from the same matchers would time a cache), in rotating order:
ll_batch, llguidance's LLExecutor.unsafe_compute_mask_ptr into one [B, W] int32 buffer, as
moe_serve/engine/structured.py fills; ll_rows, LLMatcher.unsafe_compute_mask_ptr row by row;
xg_rows, GrammarMatcher.fill_next_token_bitmask row by row into allocate_token_bitmask's buffer;
xg_batch, BatchGrammarMatcher.batch_fill_next_token_bitmask. Thread pools are left at their
defaults, as a server would leave them. Also: consuming a token (per row), each engine's tokenizer
set-up, grammar compile time (llguidance compiles lazily, in the matcher and its first mask; xgrammar
ahead of time, in GrammarCompiler.compile_json_schema, cache off), a new request's time to its first
mask, import time, each engine's installed dependency closure (MB, from the installed files), and
string_check: inside a JSON string, the tokens only one engine allows, and whether a document
through one of xgrammar's completes under xgrammar yet fails json.loads.
"""
from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import llguidance
import llguidance.hf
import torch

DEFAULT_MODEL = Path(__file__).resolve().parent.parent / "moe_serve" / "models" / "default"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "name", "tags", "score", "active"],
          "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
                         "score": {"type": "number"}, "active": {"type": "boolean"}}}
COMPILE_REPEATS = 5
# what the project installs anyway (pyproject.toml): an engine's footprint beyond these is its own
PROJECT_ALREADY = ("torch", "transformers", "tokenizers")
WORDS = ("alpha", "delta", "mesh", "river", "stone", "quick", "blue", "engine", "cloud", "tensor", "Zürich",
         "paper", "north", "gate", "lemon", "orbit", "signal", "green", "market", "value", "x", "data")
US = 1e6


def synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE trained on this Python's standard library: a real model's vocabulary size for
    the mask costs, which grow with the tokenizer (no large tokenizer ships with this repository)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    texts = (f.read_text(errors="replace") for f in files)  # a few test files are not UTF-8
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")


def import_xgrammar():
    try:
        import xgrammar
    except ImportError:
        sys.exit("xgrammar is not installed here (the project does not depend on it). Make a throwaway venv:\n"
                 "  python3 -m venv /tmp/xg && /tmp/xg/bin/pip install torch==2.13.0 xgrammar transformers "
                 "tokenizers llguidance\nand run this script with /tmp/xg/bin/python.")
    return xgrammar


class Engines:
    """Both engines set up on one tokenizer; the set-up times are kept."""

    def __init__(self, xgr, hf, vocab: int) -> None:
        self.xgr, self.vocab, self.width = xgr, vocab, (vocab + 31) // 32
        self.eos = hf.eos_token_id
        started = time.perf_counter()
        self.ll_tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
        self.ll_tokenizer_s = time.perf_counter() - started
        started = time.perf_counter()
        self.xg_info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
        self.xg_tokenizer_s = time.perf_counter() - started
        schema = json.dumps(SCHEMA)
        # the same language from both: compact JSON (the server's llguidance default), properties in order
        self.ll_grammar = llguidance.LLMatcher.grammar_from_json_schema(schema,
                                                                        defaults={"whitespace_flexible": False})
        self.compile_xg = lambda compiler: compiler.compile_json_schema(schema, any_whitespace=False,
                                                                        separators=(",", ":"))
        self.xg_compiled = self.compile_xg(xgr.GrammarCompiler(self.xg_info))

    def ll_matcher(self) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.ll_grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def xg_matcher(self):
        return self.xgr.GrammarMatcher(self.xg_compiled)


def compile_times(engines: Engines) -> dict:
    """Seconds (median of COMPILE_REPEATS, and the first) from a grammar's text to a request's first mask."""
    xgr, rows = engines.xgr, {k: [] for k in ("ll_matcher_s", "ll_first_mask_s", "xg_compile_s",
                                                 "xg_matcher_s", "xg_first_mask_s")}
    ll_bits = torch.empty(1, engines.width, dtype=torch.int32)
    xg_bits = xgr.allocate_token_bitmask(1, engines.vocab)
    for _ in range(COMPILE_REPEATS):
        t0 = time.perf_counter()
        matcher = engines.ll_matcher()  # the server builds one per request: this is its compile
        t1 = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(ll_bits.data_ptr(), engines.width * 4)
        t2 = time.perf_counter()
        rows["ll_matcher_s"].append(t1 - t0)
        rows["ll_first_mask_s"].append(t2 - t0)
        t0 = time.perf_counter()
        compiled = engines.compile_xg(xgr.GrammarCompiler(engines.xg_info, cache_enabled=False))
        t1 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiled)  # a cached grammar's request starts here
        t2 = time.perf_counter()
        matcher.fill_next_token_bitmask(xg_bits, 0)
        t3 = time.perf_counter()
        rows["xg_compile_s"].append(t1 - t0)
        rows["xg_matcher_s"].append(t2 - t1)
        rows["xg_first_mask_s"].append(t3 - t0)
    return {**{k: statistics.median(v) for k, v in rows.items()},
            "first": {k: v[0] for k, v in rows.items()}, "repeats": COMPILE_REPEATS,
            "note": "ll_first_mask_s: matcher + first mask (llguidance compiles lazily, and the server makes a "
                    "matcher per request); xg_first_mask_s: compile (cache off) + matcher + first fill. A request "
                    "whose grammar xgrammar has cached pays xg_matcher_s + one fill."}


def allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """The token ids a [W] int32 mask row allows, below vocab."""
    unpacked = (bits[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [W, 32]
    return unpacked.flatten()[:vocab].nonzero().flatten()


def document(rng: random.Random) -> str:
    """A compact JSON document valid under SCHEMA, with the kind of values a model writes."""
    def words(limit: int) -> str:
        text = rng.choice(WORDS)
        while len(text) < limit and rng.random() < 0.6:
            text = f"{text} {rng.choice(WORDS)}"
        return text[:limit].rstrip()

    doc = {"id": rng.randrange(10 ** rng.randint(1, 6)), "name": words(24).title(),
           "tags": [words(12) for _ in range(rng.randint(0, 4))],
           "score": round(rng.uniform(-100, 100), rng.randint(0, 3)), "active": rng.random() < 0.5}
    return json.dumps(doc, separators=(",", ":"))


def bench_masks(engines: Engines, hf, walk: str, batch: int, steps: int, seed: int) -> dict:
    """B rows through both engines for `steps` mask steps; the tokens come from a random walk over the
    tokens both allow ("random", as structured_mask.py walks) or from tokenized documents ("documents").

    Each way of filling has matchers of its own, all fed the same tokens: llguidance keeps a state's
    mask once computed, so a second fill from the same matchers would time a cached mask."""
    xgr, vocab, width = engines.xgr, engines.vocab, engines.width
    rng = random.Random(seed)
    executor, xg_batch = llguidance.LLExecutor(), xgr.BatchGrammarMatcher()
    rows = list(range(batch))
    bits = {"ll_batch": torch.empty(batch, width, dtype=torch.int32),
            "ll_rows": torch.empty(batch, width, dtype=torch.int32),
            "xg_rows": xgr.allocate_token_bitmask(batch, vocab), "xg_batch": xgr.allocate_token_bitmask(batch, vocab)}
    matchers = {name: [None] * batch for name in bits}  # arm -> its B matchers
    todo = [[] for _ in rows]  # "documents": each row's tokens still to walk, last first

    def start(k: int) -> None:
        for name, ms in matchers.items():
            ms[k] = engines.ll_matcher() if name.startswith("ll") else engines.xg_matcher()
        if walk == "documents":
            todo[k] = hf.encode(document(rng), add_special_tokens=False)[::-1]

    def fill_ll_batch():  # as moe_serve/engine/structured.py fills a step's rows
        executor.unsafe_compute_mask_ptr(list(zip(matchers["ll_batch"], rows)), bits["ll_batch"].data_ptr(),
                                         width * 4, batch)

    def fill_ll_rows():
        for k, matcher in enumerate(matchers["ll_rows"]):
            matcher.unsafe_compute_mask_ptr(bits["ll_rows"].data_ptr() + k * width * 4, width * 4)

    def fill_xg_rows():
        for k, matcher in enumerate(matchers["xg_rows"]):
            matcher.fill_next_token_bitmask(bits["xg_rows"], k)

    def fill_xg_batch():
        xg_batch.batch_fill_next_token_bitmask(matchers["xg_batch"], bits["xg_batch"])

    for k in rows:
        start(k)
    arms = [("ll_batch", fill_ll_batch), ("ll_rows", fill_ll_rows), ("xg_rows", fill_xg_rows),
            ("xg_batch", fill_xg_batch)]
    times = {name: [] for name, _ in arms}
    ll_advance, xg_advance, same_rows, allowed_counts = [], [], 0, []
    documents, disagreements, tokens, refused = batch, 0, 0, {"llguidance": 0, "xgrammar": 0}
    for step in range(steps + 1):  # step 0 warms up: not timed
        turn = step % len(arms)
        for name, fill in arms[turn:] + arms[:turn]:  # each arm first in turn
            started = time.perf_counter()
            fill()
            times[name].append(time.perf_counter() - started)
        for a, b in (("ll_batch", "ll_rows"), ("xg_rows", "xg_batch")):
            assert torch.equal(bits[a][:, :width], bits[b][:, :width]), f"{a} and {b} filled different masks"
        chosen = []
        for k in rows:
            ll_ids, xg_ids = allowed(bits["ll_batch"][k], vocab), allowed(bits["xg_rows"][k], vocab)
            same = torch.equal(ll_ids, xg_ids)
            same_rows += same
            allowed_counts.append(len(ll_ids))
            common = set((ll_ids if same else ll_ids[torch.isin(ll_ids, xg_ids)]).tolist())
            if walk == "random":
                options = sorted(common - {engines.eos})
                token = rng.choice(options) if options else engines.eos  # EOS: done, or the engines part
            else:
                token = todo[k].pop() if todo[k] else engines.eos
            if token == engines.eos or token not in common:  # a new document in both
                # the document was complete only if both engines allow EOS
                disagreements += token not in common or (walk == "random" and len(common) > 1)
                if token not in common:  # "documents": which engine refused the document's own token
                    refused["llguidance"] += token not in ll_ids.tolist()
                    refused["xgrammar"] += token not in xg_ids.tolist()
                documents += 1
                start(k)
                chosen.append(None)
            else:
                chosen.append(token)
        walked = [(k, t) for k, t in zip(rows, chosen) if t is not None]
        t0 = time.perf_counter()
        ok_ll = [matchers["ll_batch"][k].consume_token(t) for k, t in walked]
        t1 = time.perf_counter()
        ok_xg = [matchers["xg_rows"][k].accept_token(t) for k, t in walked]
        t2 = time.perf_counter()
        ok_ll += [matchers["ll_rows"][k].consume_token(t) for k, t in walked]
        ok_xg += [matchers["xg_batch"][k].accept_token(t) for k, t in walked]
        assert all(ok_ll) and all(ok_xg), "a token both masks allowed was refused"
        if walked and step:
            ll_advance.append((t1 - t0) / len(walked))
            xg_advance.append((t2 - t1) / len(walked))
        tokens += len(walked)
        if step == 0:
            for v in times.values():
                v.clear()
    fill = {name: statistics.median(v) * US for name, v in times.items()}
    return {"walk": walk, "batch": batch, "steps": steps, "vocab": vocab,
            **{f"{name}_fill_us_per_step": us for name, us in fill.items()},
            **{f"{name}_fill_us_per_row": us / batch for name, us in fill.items()},
            "ll_advance_us_per_row": statistics.median(ll_advance) * US,
            "xg_advance_us_per_row": statistics.median(xg_advance) * US,
            "tokens_walked": tokens, "documents_started": documents,
            "rows_where_masks_equal": same_rows / (batch * (steps + 1)),
            "documents_ended_by_disagreement": disagreements, "document_token_refused_by": refused,
            "median_allowed_tokens": statistics.median(allowed_counts)}


def string_check(engines: Engines, hf) -> dict:
    """Inside a JSON string: the tokens one engine allows and the other refuses, and for xgrammar's,
    how many complete a document under xgrammar whose text json.loads then accepts."""
    prefix, rest = ('{"id":1,"name":"a', '","tags":[],"score":1,"active":true}')
    head, tail = (hf.encode(text, add_special_tokens=False) for text in (prefix, rest))
    ll, xg = engines.ll_matcher(), engines.xg_matcher()
    assert all(ll.consume_token(t) and xg.accept_token(t) for t in head)
    ll_bits = torch.empty(1, engines.width, dtype=torch.int32)
    xg_bits = engines.xgr.allocate_token_bitmask(1, engines.vocab)
    ll.unsafe_compute_mask_ptr(ll_bits.data_ptr(), engines.width * 4)
    xg.fill_next_token_bitmask(xg_bits, 0)
    ll_ids, xg_ids = (set(allowed(bits[0], engines.vocab).tolist()) for bits in (ll_bits, xg_bits))
    only_ll, only_xg = sorted(ll_ids - xg_ids), sorted(xg_ids - ll_ids)
    completes, parses = 0, 0
    for token in only_xg:
        matcher = engines.xg_matcher()
        if all(matcher.accept_token(t) for t in [*head, token, *tail]) and matcher.accept_token(engines.eos):
            completes += 1
            try:
                json.loads(hf.decode([*head, token, *tail]))
                parses += 1
            except ValueError:
                pass
    return {"after": prefix, "only_llguidance": len(only_ll), "only_xgrammar": len(only_xg),
            "only_llguidance_examples": [hf.decode([t]) for t in only_ll[:8]],
            "only_xgrammar_examples": [hf.decode([t]) for t in only_xg[:8]],
            "xgrammar_only_completing_a_document": completes, "of_which_json_loads_accepts": parses}


def import_seconds(module: str, repeats: int = 3) -> float:
    """Median wall seconds of a fresh `python -c 'import MODULE'`."""
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True, capture_output=True)
        runs.append(time.perf_counter() - started)
    return statistics.median(runs)


def footprint(name: str) -> dict:
    """A distribution's installed dependency closure (extras left out): names and MB of installed files,
    and what of it is beyond the closure of what this project needs anyway (PROJECT_ALREADY)."""
    closure = dependency_closure([name])
    already = dependency_closure(list(PROJECT_ALREADY))
    extra = {k: v for k, v in closure.items() if k not in already}
    return {"requires": sorted(closure), "total_mb": round(sum(closure.values()), 1), "mb": closure,
            f"beyond_{'+'.join(PROJECT_ALREADY)}": sorted(extra),
            f"beyond_{'+'.join(PROJECT_ALREADY)}_mb": round(sum(extra.values()), 1)}


def dependency_closure(names: list[str]) -> dict[str, float]:
    """{"name==version": installed MB} of the distributions and all they require (extras left out)."""
    from packaging.requirements import Requirement

    seen, todo, sizes = set(), list(names), {}
    while todo:
        dist_name = todo.pop()
        key = dist_name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            sizes[key] = None  # required but not installed (its marker did not match)
            continue
        files = [f.locate() for f in dist.files or ()]
        sizes[f"{key}=={dist.version}"] = round(sum(p.stat().st_size for p in files if p.is_file()) / 2**20, 1)
        for line in dist.requires or ():
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return {k: v for k, v in sizes.items() if v is not None}


def print_and_save(result: dict, out: Path | None) -> None:
    """The report on stdout, and in `out` when given (its folder made)."""
    text = json.dumps(result, indent=1)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEFAULT_MODEL), help="checkpoint dir whose tokenizer to use")
    parser.add_argument("--synthetic-vocab", type=int, default=None,
                        help="a BPE of about this many tokens trained on the stdlib instead of --model's")
    parser.add_argument("--vocab", type=int, default=None, help="mask width (default: the tokenizer's)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=200, help="mask steps per batch size")
    parser.add_argument("--walk", nargs="+", choices=["random", "documents"], default=["random", "documents"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    xgr = import_xgrammar()
    from transformers import AutoTokenizer

    started = time.perf_counter()
    hf = synthetic_tokenizer(args.synthetic_vocab) if args.synthetic_vocab else \
        AutoTokenizer.from_pretrained(args.model)
    tokenizer_s = time.perf_counter() - started
    vocab = max(args.vocab or 0, len(hf))
    engines = Engines(xgr, hf, vocab)
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu_count": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
                    "load_avg_at_start": os.getloadavg(), "python": platform.python_version(),
                    "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "llguidance": metadata.version("llguidance"), "xgrammar": metadata.version("xgrammar"),
        "tokenizer": f"synthetic BPE ({args.synthetic_vocab})" if args.synthetic_vocab else args.model,
        "tokenizer_vocab": len(hf), "vocab": vocab, "tokenizer_load_s": tokenizer_s,
        "setup": {"ll_tokenizer_s": engines.ll_tokenizer_s, "xg_tokenizer_s": engines.xg_tokenizer_s},
        "compile": compile_times(engines),
        "string_check": string_check(engines, hf),
        "mask": [bench_masks(engines, hf, walk, b, args.steps, args.seed) for walk in args.walk for b in args.batch],
        "import_s": {"llguidance": import_seconds("llguidance"), "xgrammar": import_seconds("xgrammar")},
        "footprint": {"llguidance": footprint("llguidance"), "xgrammar": footprint("xgrammar")},
    }
    print_and_save(result, args.out)


if __name__ == "__main__":
    main()
