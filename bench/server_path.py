"""The server path alone: output tok/s and CPU time per token of N streaming clients, A/B between trees.

    python bench/server_path.py --out /tmp/server_path.json                          # this tree only
    git worktree add /tmp/head HEAD
    python bench/server_path.py --trees . /tmp/head --rounds 8 --out /tmp/server_path.json
    python bench/server_path.py --trees . /tmp/head --model moe_serve/models/default --server-args "--device cuda"

Why: on the H100 the engine alone decoded 24.9k tok/s at 32 sequences but 32 streaming clients got
2.6k through HTTP. Here the model is the tiny random checkpoint of the tests (3 layers, vocabulary
128) on the CPU unless --model says otherwise, so model compute is small and what is left is the
path every token takes: engine outbox -> supervisor thread -> event loop -> decode -> SSE. Each
tree (a checkout of the repository; its own copy of moe_serve is what the server imports) runs
its own server; all start first, then the timed rounds alternate between them with the order
rotating, so drift of a shared, noisy machine hits every tree alike.

--fake-step-ms S goes further: the engine process keeps its scheduler and message loop but
replaces the model by a stub that answers every scheduled sequence with a token after sleeping S
ms (a sitecustomize on the server's PYTHONPATH patches EngineCore.step in the engine process),
so the engine runs at a GPU's pace (H100: 32 sequences per ~1.3 ms step) and only the server
path limits the rate. Its tokens are not a model's; the text is not checked here (the tests do).

Per round: C closed-loop clients each stream R chat completions of T tokens (greedy, ignore_eos,
so every round does the same work; logprobs with 5 alternatives, as loadtest/run.py asks), over raw httpx with as little parsing as possible. Reported:
output tok/s (usage tokens / wall time), CPU seconds per token of the server process (event loop
+ supervisor thread, not its children) and of the engine process, SSE events per token (1 when
every token is its own chunk), TPOT p50. The summary gives each tree's median and range and the
per-round ratios against the first tree.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 300

# Loaded by every Python process of a server started with --fake-step-ms; patches only when the
# engine's core is imported (the engine process imports it; the server process does not).
FAKE_STEP_SITECUSTOMIZE = """
import os, sys, time

def _patch(core):
    from moe_serve.engine.messages import TokenLogprob
    step_s = float(os.environ["MOE_BENCH_FAKE_STEP_MS"]) / 1e3

    def step(self):
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return []
        time.sleep(step_s)  # the forward's time on the accelerator
        outputs = []
        for chunk in scheduled.chunks:
            self.scheduler.advance(chunk)
            seq = chunk.seq
            if not chunk.samples:
                continue
            token = 40 + len(seq.output_ids) % 50  # printable characters of the tiny tokenizer
            # with as many alternatives as asked for (top_logprobs), as the real sampler gives
            top = tuple((40 + (token + k) % 50, -1.0 - k) for k in range(seq.params.logprobs or 0))
            logprob = TokenLogprob(token, -0.5, top) if seq.params.logprobs is not None else None
            if seq.append(token, logprob, self.runtime.max_model_len):
                self.scheduler.finish(seq)
            outputs.append(self._output(seq))
        return outputs

    core.EngineCore.step = step

class _Finder:
    def find_spec(self, name, path=None, target=None):
        if name != "moe_serve.engine.core":
            return None
        sys.meta_path.remove(self)
        import importlib.util
        spec = importlib.util.find_spec(name)
        loader_exec = spec.loader.exec_module
        def exec_module(module):
            loader_exec(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec

if os.environ.get("MOE_BENCH_FAKE_STEP_MS"):
    sys.meta_path.insert(0, _Finder())
"""


@dataclass
class Round:
    tree: str
    tokens: int = 0
    events: int = 0
    requests: int = 0
    wall_s: float = 0.0
    server_cpu_s: float = 0.0
    engine_cpu_s: float = 0.0
    tpots_ms: list[float] = field(default_factory=list)

    def row(self) -> dict:
        return {"tree": self.tree, "tok_s": self.tokens / self.wall_s,
                "server_cpu_us_per_token": 1e6 * self.server_cpu_s / self.tokens,
                "engine_cpu_us_per_token": 1e6 * self.engine_cpu_s / self.tokens,
                "events_per_token": self.events / self.tokens,
                "tpot_p50_ms": statistics.median(self.tpots_ms), "tokens": self.tokens, "requests": self.requests,
                "wall_s": self.wall_s}


@dataclass
class Server:
    tree: Path
    process: subprocess.Popen
    base_url: str
    log_path: Path

    def cpu_seconds(self) -> tuple[float, float]:
        """(server process, its children: the engine and multiprocessing's helpers)."""
        main = psutil.Process(self.process.pid)
        children = 0.0
        for child in main.children(recursive=True):
            try:
                t = child.cpu_times()
                children += t.user + t.system
            except psutil.NoSuchProcess:
                pass
        t = main.cpu_times()
        return t.user + t.system, children


def tiny_model(root: Path) -> Path:
    sys.path.insert(0, str(REPO))
    from tests.server.tiny_tokenizer import build_tiny_tokenizer
    from tests.tiny_checkpoints import build_tiny_checkpoint

    path = root / "tiny-moe"
    build_tiny_checkpoint("mixtral", path)
    build_tiny_tokenizer(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tree: Path, model: Path, server_args: list[str], clients: int, log_dir: Path,
                 fake_step_ms: float | None) -> Server:
    port = free_port()
    log_path = log_dir / f"server-{port}.log"
    cmd = [sys.executable, "-m", "moe_serve.server", "--model", str(model), "--port", str(port),
           "--max-queue", str(max(64, clients)), *server_args]
    # the tree's own package: -m puts the working directory first on sys.path; PYTHONPATH reaches the engine too
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    if fake_step_ms is not None:
        (log_dir / "sitecustomize.py").write_text(FAKE_STEP_SITECUSTOMIZE)
        env |= {"PYTHONPATH": f"{tree}{os.pathsep}{log_dir}", "MOE_BENCH_FAKE_STEP_MS": str(fake_step_ms)}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = Server(tree, process, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server for {tree} exited:\n{log_path.read_text()[-3000:]}")
        try:
            if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server for {tree} not healthy after {START_TIMEOUT_S}s")


async def stream_one(http: httpx.AsyncClient, server: Server, model: str, max_tokens: int, n: int, rnd: Round) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": f"request {n}: say something"}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 5, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    tokens = 0
    async with http.stream("POST", server.base_url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                break
            rnd.events += 1
            if '"usage":{' in line:  # the closing usage chunk: the only one parsed
                tokens = json.loads(line[6:])["usage"]["completion_tokens"]
                continue
            last = time.perf_counter()
            first = first or last
    if not tokens:
        raise RuntimeError("a stream ended without its usage chunk")
    rnd.events -= 1  # the usage chunk carries no token
    rnd.tokens += tokens
    rnd.requests += 1
    if first is not None and tokens > 1:
        rnd.tpots_ms.append(1e3 * (last - first) / (tokens - 1))


async def run_round(server: Server, model: str, clients: int, per_client: int, max_tokens: int) -> Round:
    rnd = Round(str(server.tree))
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def client(c: int) -> None:
            for r in range(per_client):
                await stream_one(http, server, model, max_tokens, c * per_client + r, rnd)

        cpu_before = server.cpu_seconds()
        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in range(clients)))
        rnd.wall_s = time.perf_counter() - started
        cpu_after = server.cpu_seconds()
    rnd.server_cpu_s, rnd.engine_cpu_s = (a - b for a, b in zip(cpu_after, cpu_before))
    return rnd


def summarize(rows: list[dict], trees: list[str]) -> dict:
    keys = ("tok_s", "server_cpu_us_per_token", "engine_cpu_us_per_token", "events_per_token", "tpot_p50_ms")
    by_tree = {t: [r for r in rows if r["tree"] == t] for t in trees}
    summary: dict = {t: {k: {"median": statistics.median(r[k] for r in rs), "min": min(r[k] for r in rs),
                             "max": max(r[k] for r in rs)} for k in keys} for t, rs in by_tree.items()}
    base = by_tree[trees[0]]
    for t in trees[1:]:  # round i of the first tree against round i of this one (run back to back)
        ratios = {k: sorted(b[k] / o[k] for b, o in zip(base, by_tree[t])) for k in keys}
        summary[t]["first_tree_over_this_per_round"] = ratios
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", default=[str(REPO)], help="repository checkouts; the first is the base")
    parser.add_argument("--model", help="checkpoint folder (default: the tests' tiny random checkpoint, built here)")
    parser.add_argument("--server-args", default="--device cpu --max-model-len 256")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per tree, after one untimed warm-up")
    parser.add_argument("--fake-step-ms", type=float,
                        help="replace the model by a stub answering every sequence after this many ms per step")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    trees = [Path(t).resolve() for t in args.trees]
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model).resolve() if args.model else tiny_model(Path(tmp))
        servers = []
        try:
            for tree in trees:
                servers.append(start_server(tree, model, shlex.split(args.server_args), args.clients, Path(tmp),
                                            args.fake_step_ms))
            rows = asyncio.run(_rounds(servers, model.name, args))
        finally:
            for server in servers:
                server.process.terminate()
                server.process.wait(timeout=60)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "cpu_count": os.cpu_count(), "rounds": rows,
              "summary": summarize(rows, [str(t) for t in trees])}
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


async def _rounds(servers: list[Server], model: str, args: argparse.Namespace) -> list[dict]:
    for server in servers:  # warm-up, untimed
        await run_round(server, model, args.clients, 1, args.max_tokens)
    rows = []
    for i in range(args.rounds):
        order = servers[i % len(servers):] + servers[:i % len(servers)]  # no tree always first
        for server in order:
            rnd = await run_round(server, model, args.clients, args.requests_per_client, args.max_tokens)
            rows.append(rnd.row())
            print(json.dumps({"round": i, **{k: (round(v, 3) if isinstance(v, float) else v)
                                             for k, v in rows[-1].items()}}), flush=True)
    return rows


if __name__ == "__main__":
    main()
