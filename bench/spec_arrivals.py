"""Batched speculation while requests keep arriving: prefill chunks riding in the verify forward
against such steps decoding plainly (the engine before they could ride), one engine, one call.

    python bench/spec_arrivals.py --out $OUT/spec-arrivals-mixtral-25.json

The Mixtral-size default model (352 MB experts) at a 25% LRU budget with --spec draft (the
default draft model, gamma 12). A closed loop of C clients: C greedy requests of 64 tokens
(prompts of 24-63 random token ids), each one that finishes replaced by a new one until 3 C have
run, so arrivals keep landing beside speculating sequences. The old behaviour is the same engine
with EngineCore._could_speculate refusing any step that has prefill chunks. The two alternate
(old, new, old, new) after an untimed warm-up; per run: output tokens over wall time, and the
speculative rounds that carried prefill chunks.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.checkpoints import expanded_default  # noqa: E402
from moe_serve.engine.config import EngineConfig  # noqa: E402
from moe_serve.engine.core import EngineCore  # noqa: E402
from moe_serve.engine.messages import GenerateRequest, SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


class ClosedLoop:
    """One engine, its speculator counting the rounds that carry prefill chunks."""

    def __init__(self, core: EngineCore, prompts: list[list[int]]) -> None:
        self.core, self.prompts, self.carried = core, prompts, 0
        self._could_speculate = core._could_speculate
        speculator = core.runtime.speculator
        verify = speculator.draft_and_verify

        def counting(seqs, max_model_len, chunks=None):
            self.carried += bool(chunks)
            return verify(seqs, max_model_len, chunks)

        speculator.draft_and_verify = counting

    def run(self, riders: bool, concurrency: int, total: int, tag: str) -> dict:
        could = self._could_speculate
        self.core._could_speculate = could if riders else (lambda c, d, r: not r and could(c, d, r))
        self.carried, added, tokens = 0, 0, 0

        def add() -> None:
            nonlocal added
            prompt = tuple(self.prompts[added % len(self.prompts)])
            request = GenerateRequest(f"{tag}-{added}", prompt, SamplingParams(max_tokens=64, temperature=0))
            assert self.core.add_request(request) is None
            added += 1

        start = time.perf_counter()
        for _ in range(concurrency):
            add()
        while self.core.has_unfinished():
            for out in self.core.step():
                assert out.error is None, out.error
                tokens += len(out.new_token_ids)
                if out.finish_reason and added < total:
                    add()
        seconds = time.perf_counter() - start
        return {"riders": riders, "c": concurrency, "tok_s": tokens / seconds, "seconds": seconds,
                "tokens": tokens, "rounds_with_riders": self.carried}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--work", default="/tmp/default-352mb", help="where the Mixtral-size model is built")
    args = parser.parse_args()
    model = Path(args.work)
    if not model.exists():
        expanded_default(REPO / "moe_serve" / "models" / "default", model, 352.0)
    core = EngineCore(EngineConfig(model=str(model), device="cuda", gpu_expert_budget="25%", cache_policy="lru",
                                   spec="draft", draft=str(REPO / "moe_serve" / "models" / "default-draft"),
                                   spec_tokens=12, max_model_len=512))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 8000, (int(torch.randint(24, 64, (1,), generator=gen)),), generator=gen).tolist()
               for _ in range(64)]
    loop, rows = ClosedLoop(core, prompts), []
    try:
        loop.run(True, max(args.concurrency), 24, "warm-up")
        for c in args.concurrency:
            for r in range(2):
                for riders in (False, True):
                    rows.append(loop.run(riders, c, 3 * c, f"c{c}-{r}-{riders}"))
                    print(json.dumps(rows[-1]), flush=True)
    finally:
        core.close()
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(),
                                          "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
