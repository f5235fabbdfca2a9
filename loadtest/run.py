"""Load test for moe-serve: closed-loop streaming clients on the async OpenAI SDK, every answer verified.

    python -m loadtest.run --spawn --model moe_serve/models/default --concurrency 1,8,64 --requests 200 --out r.json
    python -m loadtest.run --base-url http://127.0.0.1:8000 --concurrency 64 --duration 600 --server-pid PID

Flow: seeded prompts -> one non-streamed greedy reference per prompt, fetched one at a time ->
per concurrency level an untimed warm-up, then the timed phase -> one JSON report. A level's
clients run in --client-processes processes (default: at most 4 clients each), so that parsing
the streams does not bound what is measured.

Verification. Every request is greedy, so each streamed answer must equal its prompt's
reference (text, finish_reason, usage): a mixed-up, truncated or duplicated answer cannot
pass. Requests ask for logprobs, which carry one entry per generated token except EOS, so
the tokens received are counted and compared with `usage` (stream_options.include_usage).
A sample of requests goes over raw httpx instead of the SDK, because the SDK swallows the
closing `data: [DONE]` and that sample checks every stream ends with it.
`--match top5` relaxes only the comparison with the reference, to vLLM's check_logprobs_close
(for bf16 on a GPU, where the batch a sequence shares a step with can flip a near-tie): equal
tokens up to the first divergence, and there each side's token in the other's top-5 logprobs.

Metrics are vLLM benchmark_serving's: TTFT = request sent -> first chunk with choices;
ITL = gaps between later chunks; E2E latency = request sent -> last data chunk;
TPOT = (latency - TTFT) / (output tokens - 1) per request; goodput = requests/s that meet
every SLO given (--slo-ttft, --slo-tpot, in ms). Errors are counted by HTTP status; an error
event inside a 200 stream counts as `stream_error:<code>`.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import multiprocessing
import os
import queue
import random
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from multiprocessing.process import BaseProcess
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Literal, Self

import httpx
import openai
import psutil

REPO = Path(__file__).resolve().parents[1]
WORDS = ("def", "return", "list", "dict", "sorted", "reverse", "string", "parse", "file", "path", "json",
         "yield", "class", "import", "async", "await", "lambda", "tuple", "set", "index", "range", "filter",
         "map", "sum", "count", "split", "join", "strip", "format", "read", "write", "open", "close", "key",
         "value", "error", "raise", "try", "except", "loop", "while", "for", "if", "else", "print", "test",
         "assert")  # prompt vocabulary: the default model is a code model
MAX_RETRY_AFTER_S = 5.0
Match = Literal["exact", "top5"]  # how an answer is compared with its reference (see verify)
MATCHES: tuple[Match, ...] = ("exact", "top5")
TOP_LOGPROBS = 5  # top5: alternatives asked per token, as vLLM's tests call check_logprobs_close


# ---- workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    base_url: str  # scheme://host:port, without /v1
    model: str
    api_key: str


@dataclass(frozen=True)
class Prompt:
    index: int
    text: str
    max_tokens: int


def spread(mean: int, ratio: float, rng: random.Random) -> int:
    """Uniform in [mean * (1 - ratio), mean * (1 + ratio)], at least 1: vLLM's random dataset's range_ratio."""
    return max(1, rng.randint(round(mean * (1 - ratio)), round(mean * (1 + ratio))))


def make_prompts(count: int, words: int, max_tokens: int, ratio: float, seed: int) -> list[Prompt]:
    """Distinct seeded prompts (each starts with its own index), lengths drawn per prompt."""
    rng = random.Random(seed)
    return [Prompt(i, f"#{i} " + " ".join(rng.choices(WORDS, k=spread(words, ratio, rng))),
                   spread(max_tokens, ratio, rng)) for i in range(count)]


def request_fields(target: Target, prompt: Prompt, match: Match = "exact") -> dict:
    fields = {"model": target.model, "messages": [{"role": "user", "content": prompt.text}],
              "max_tokens": prompt.max_tokens, "temperature": 0, "logprobs": True}
    return (fields | {"top_logprobs": TOP_LOGPROBS}) if match == "top5" else fields


# ---- one response: parse, time, verify ------------------------------------------------------


@dataclass(frozen=True)
class Token:
    """One generated token as its logprobs entry names it, with the entry's top alternatives.

    Compared by the `token` string, not `bytes`: this server derives `bytes` from that string
    (moe_serve/server/responses.py), so they say the same, and `bytes` may be null in OpenAI's schema.
    Neither tells apart two tokens that are both a split UTF-8 character (both read U+FFFD).
    """

    text: str
    top: tuple[str, ...]

    @classmethod
    def of(cls, entry: dict) -> Token:
        return cls(entry["token"], tuple(alt["token"] for alt in entry.get("top_logprobs") or ()))


@dataclass(frozen=True)
class Answer:
    """The part of a response that must equal the prompt's reference (tokens: top5 only, see verify)."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    tokens: tuple[Token, ...] = field(default=(), compare=False, repr=False)


@dataclass(frozen=True)
class Divergence:
    """Where a top5 answer left its reference's path legitimately: each token in the other's top-5."""

    position: int
    answer_token: str
    reference_token: str


@dataclass
class Result:
    prompt: int
    via: str  # "sdk" | "raw"
    start: float
    end: float = 0.0  # when the client was done with it (set by run_phase)
    status: str = "ok"  # ok | disconnected | HTTP status | stream_error:<code> | timeout | connection
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    retry_after: float = 0.0
    error: str = ""  # what a connection error said
    problems: list[str] = field(default_factory=list)  # verification failures: a wrong answer
    divergence: Divergence | None = None  # top5: the accepted divergence from the reference, if any


def tokens_received(logprob_entries: int, finish_reason: str | None) -> int:
    """Generated tokens a client saw: a logprob entry each, plus the EOS that ends a "stop" choice.

    The server counts EOS in usage but sends no logprob for it; these requests use no stop strings,
    so finish_reason "stop" always means EOS.
    """
    return logprob_entries + (finish_reason == "stop")


class StreamCheck:
    """One stream's chunks as they arrive: vLLM-style timing and the chat chunk protocol."""

    def __init__(self, result: Result, match: Match = "exact") -> None:
        self.result, self.match = result, match
        self.text, self.finish_reason, self.usage = "", None, None
        self.tokens: list[Token] = []  # top5 only
        self.ids: set[str] = set()
        self.chunks = self.logprob_entries = 0
        self.last_at = result.start
        self.protocol: list[str] = []

    def add(self, chunk: dict, at: float) -> None:
        self.ids.add(chunk.get("id"))
        if chunk.get("choices"):
            self._choice(chunk["choices"], at)
        elif chunk.get("usage"):
            self.usage = chunk["usage"]
        else:
            self.protocol.append(f"chunk {self.chunks} has neither choices nor usage")
        if self.usage is not None and chunk.get("choices"):
            self.protocol.append("a chunk with choices came after the usage chunk")
        self.last_at = at
        self.chunks += 1

    def _choice(self, choices: list[dict], at: float) -> None:
        if self.result.ttft is None:
            self.result.ttft = at - self.result.start
            if choices[0]["delta"].get("role") != "assistant":
                self.protocol.append("the first chunk does not carry role 'assistant'")
        else:
            self.result.itl.append(at - self.last_at)
        if self.finish_reason is not None:
            self.protocol.append("a chunk came after the one with finish_reason")
        choice = choices[0]
        self.text += choice["delta"].get("content") or ""
        entries = (choice.get("logprobs") or {}).get("content") or []
        if self.match == "top5":
            self._keep_tokens(entries)
        self.logprob_entries += len(entries)
        self.finish_reason = choice.get("finish_reason")

    def _keep_tokens(self, entries: list[dict]) -> None:
        for entry in entries:
            self.tokens.append(Token.of(entry))
            if len(self.tokens[-1].top) != TOP_LOGPROBS:
                self.protocol.append(f"token {len(self.tokens) - 1} carries {len(self.tokens[-1].top)} "
                                     f"top_logprobs, {TOP_LOGPROBS} were asked for")

    def answer(self) -> Answer:
        usage = self.usage or {}
        return Answer(self.text, self.finish_reason, usage.get("prompt_tokens", -1), usage.get("completion_tokens", -1),
                      tuple(self.tokens))

    def problems(self) -> list[str]:
        found = list(self.protocol)
        if len(self.ids) > 1:
            found.append(f"chunks carry {len(self.ids)} different ids")
        if self.usage is None:
            found.append("no usage chunk")
        elif (got := tokens_received(self.logprob_entries, self.finish_reason)) != self.usage["completion_tokens"]:
            found.append(f"received {got} tokens, usage says {self.usage['completion_tokens']}")
        return found


def verify(answer: Answer, reference: Answer, match: Match) -> tuple[list[str], Divergence | None]:
    """What makes the answer wrong, and (top5) the divergence that was accepted.

    exact: text, finish_reason and usage equal the reference's. top5 (vLLM's check_logprobs_close):
    the tokens are equal up to the first divergence, where each side's token is in the other's
    top-5; after it the two follow different paths, so only prompt_tokens is still compared.
    Without a divergence top5 is exact (and the token lists have the same length).
    """
    if match == "exact":
        return exact_problems(answer, reference), None
    at = next((i for i, (a, r) in enumerate(zip(answer.tokens, reference.tokens)) if a.text != r.text), None)
    if at is None:
        return exact_problems(answer, reference) + length_problems(answer, reference), None
    problems = divergence_problems(at, answer.tokens[at], reference.tokens[at])
    if answer.prompt_tokens != reference.prompt_tokens:
        problems.append(f"prompt_tokens {answer.prompt_tokens}, the reference's {reference.prompt_tokens}")
    accepted = Divergence(at, answer.tokens[at].text, reference.tokens[at].text)
    return problems, None if problems else accepted


def exact_problems(answer: Answer, reference: Answer) -> list[str]:
    return [] if answer == reference else [f"answer {answer} differs from the reference {reference}"]


def length_problems(answer: Answer, reference: Answer) -> list[str]:
    if len(answer.tokens) == len(reference.tokens):
        return []
    return [f"{len(answer.tokens)} tokens, the reference {len(reference.tokens)}, equal as far as both go"]


def divergence_problems(at: int, answer: Token, reference: Token) -> list[str]:
    """The first divergence is legitimate only if each side's token is in the other's top-5."""
    missing = ([f"the answer's token is not in the reference's top-5 {list(reference.top)}"]
               if answer.text not in reference.top else [])
    missing += ([f"the reference's token is not in the answer's top-5 {list(answer.top)}"]
                if reference.text not in answer.top else [])
    if not missing:
        return []
    return [f"token {at}: answer {answer.text!r}, reference {reference.text!r}: " + "; ".join(missing)]


def finish(result: Result, check: StreamCheck, reference: Answer, match: Match = "exact") -> None:
    """Close the books on a stream that ended normally: latency, token counts, verification."""
    answer = check.answer()
    result.latency = check.last_at - result.start
    result.prompt_tokens, result.output_tokens = answer.prompt_tokens, answer.completion_tokens
    result.problems += check.problems()
    problems, result.divergence = verify(answer, reference, match)
    result.problems += problems


# ---- requests: the SDK, raw httpx, references -----------------------------------------------


async def sdk_request(client: openai.AsyncOpenAI, target: Target, prompt: Prompt, reference: Answer,
                      disconnect_after: int | None, match: Match = "exact") -> Result:
    result = Result(prompt.index, "sdk", time.perf_counter())
    check = StreamCheck(result, match)
    try:
        stream = await client.chat.completions.create(**request_fields(target, prompt, match), stream=True,
                                                      stream_options={"include_usage": True})
        async with stream:  # leaving it closes the connection: that is how a client disconnects
            if disconnect_after == 0:
                result.status = "disconnected"
                return result
            async for chunk in stream:
                check.add(chunk.model_dump(), time.perf_counter())
                if check.chunks == disconnect_after:
                    result.status = "disconnected"
                    return result
    except openai.APIStatusError as exc:
        result.status = str(exc.status_code)
        result.retry_after = _retry_after(exc.response.headers)
        result.problems += error_shape_problems(exc.body if isinstance(exc.body, dict) else None, wrapped=False)
        return result
    except openai.APITimeoutError:
        result.status = "timeout"
        return result
    except openai.APIConnectionError as exc:
        result.status, result.error = "connection", _cause(exc)
        return result
    except openai.APIError as exc:  # the SDK raises an error event inside a 200 stream as a plain APIError
        result.status = f"stream_error:{exc.code}"
        return result
    except ValueError as exc:  # a data line the SDK could not parse as JSON
        result.problems.append(f"unparseable stream: {exc}")
        return result
    finish(result, check, reference, match)
    return result


async def raw_request(http: httpx.AsyncClient, target: Target, prompt: Prompt, reference: Answer,
                      disconnect_after: int | None, match: Match = "exact") -> Result:
    """The same request without the SDK, reading the SSE lines themselves to see [DONE] arrive last."""
    result = Result(prompt.index, "raw", time.perf_counter())
    check = StreamCheck(result, match)
    body = {**request_fields(target, prompt, match), "stream": True, "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", f"{target.base_url}/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {target.api_key}"}) as resp:
            if resp.status_code != 200:
                result.status, result.retry_after = str(resp.status_code), _retry_after(resp.headers)
                body = _json_or_none(await resp.aread())
                result.problems += error_shape_problems(body if isinstance(body, dict) else None)
                return result
            done = await _read_events(resp, check, result, disconnect_after)
    except httpx.TimeoutException:
        result.status = "timeout"
        return result
    except httpx.TransportError as exc:
        result.status, result.error = "connection", _cause(exc)
        return result
    if result.status == "disconnected":
        return result
    if not done:
        result.problems.append("the stream ended without data: [DONE]")
    if result.status == "ok":
        finish(result, check, reference, match)
    return result


async def _read_events(resp: httpx.Response, check: StreamCheck, result: Result,
                       disconnect_after: int | None) -> bool:
    """Feed SSE data lines to check; returns whether [DONE] came, and came last."""
    if disconnect_after == 0:
        result.status = "disconnected"
        return False
    done = False
    async for line in resp.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators and ": ping" comments
        data = line[len("data:"):].strip()
        if done:
            result.problems.append("data after [DONE]")
        elif data == "[DONE]":
            done = True
        elif not isinstance(chunk := _json_or_none(data), dict):
            result.problems.append(f"a data line that is not a JSON object: {data[:80]!r}")
        elif "error" in chunk:
            result.status = f"stream_error:{chunk['error'].get('code')}"
            result.problems += error_shape_problems(chunk)
        else:
            check.add(chunk, time.perf_counter())
            if check.chunks == disconnect_after:
                result.status = "disconnected"
                return False
    return done


def error_shape_problems(body: dict | None, wrapped: bool = True) -> list[str]:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}} (the SDK unwraps "error")."""
    error = (body or {}).get("error") if wrapped else body
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"}:
        return [f"error body not in OpenAI's shape: {body!r}"]
    return [] if isinstance(error["message"], str) and isinstance(error["type"], str) else [f"bad error: {body!r}"]


def _json_or_none(raw: bytes | str) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _cause(exc: BaseException) -> str:
    """The innermost exception, which names what the transport saw (the SDK wraps httpx's)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}"


def _retry_after(headers: Mapping[str, str]) -> float:
    try:
        return min(float(headers.get("retry-after", 0)), MAX_RETRY_AFTER_S)
    except ValueError:
        return 0.0


async def fetch_reference(client: openai.AsyncOpenAI, target: Target, prompt: Prompt,
                          match: Match = "exact") -> Answer:
    """One prompt's non-streamed greedy answer, asked while nothing else runs."""
    resp = await client.chat.completions.create(**request_fields(target, prompt, match))
    choice = resp.choices[0]
    content = (choice.logprobs.content if choice.logprobs else None) or []
    entries = len(content)
    if tokens_received(entries, choice.finish_reason) != resp.usage.completion_tokens:
        raise RuntimeError(f"prompt {prompt.index}: {entries} logprobs entries but usage {resp.usage}")
    tokens = tuple(Token.of(e.model_dump()) for e in content) if match == "top5" else ()
    if any(len(t.top) != TOP_LOGPROBS for t in tokens):
        raise RuntimeError(f"prompt {prompt.index}: a logprobs entry without {TOP_LOGPROBS} top_logprobs")
    return Answer(choice.message.content or "", choice.finish_reason, resp.usage.prompt_tokens,
                  resp.usage.completion_tokens, tokens)


# ---- phases: closed-loop clients ------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    """How the requests of a phase are sent; request j's choices are seeded by (seed, j)."""

    raw_fraction: float = 0.1
    disconnect_fraction: float = 0.0  # these close their stream after a random number of chunks
    seed: int = 0

    def plan(self, j: int, prompts: list[Prompt], refs: list[Answer]) -> tuple[Prompt, bool, int | None]:
        rng = random.Random(f"{self.seed}/{j}")
        prompt = prompts[j % len(prompts)]  # consecutive requests, so concurrent ones, have distinct prompts
        raw = rng.random() < self.raw_fraction
        cut = rng.randrange(refs[prompt.index].completion_tokens) if rng.random() < self.disconnect_fraction else None
        return prompt, raw, cut


@asynccontextmanager
async def clients(target: Target, concurrency: int, timeout: float) -> AsyncIterator[
        tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    """The SDK (its own pool: 1000 connections) and a raw pool sized so no request waits for a connection.

    No retries: a 429 or 503 is counted, then the client waits its Retry-After before the next request.
    """
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http, \
            openai.AsyncOpenAI(base_url=f"{target.base_url}/v1", api_key=target.api_key, max_retries=0,
                               timeout=timeout) as sdk:
        yield sdk, http


async def run_phase(target: Target, prompts: list[Prompt], refs: list[Answer], concurrency: int, mix: Mix,
                    timeout: float, requests: int | None = None, duration: float | None = None,
                    on_result: Callable[[Result], None] = lambda r: None, match: Match = "exact",
                    share: range | None = None, ready: Callable[[], None] = lambda: None) -> tuple[list[Result], float]:
    """`concurrency` clients each send a request as soon as their previous one ended (after Retry-After
    on a 429/503) until `requests` were started or `duration` seconds passed. Returns (results, seconds).

    A client process runs only its `share` of the client slots range(concurrency), and the requests
    request_indices gives that share; `ready` is called once its clients are set up, and returns when
    they may start (with the other processes')."""
    share = share if share is not None else range(concurrency)
    results: list[Result] = []
    next_j = request_indices(share, concurrency, requests)

    async with clients(target, len(share), timeout) as (sdk, http):
        ready()
        started = time.perf_counter()
        deadline = started + duration if duration is not None else float("inf")

        async def client() -> None:
            for j in next_j:
                if time.perf_counter() >= deadline:
                    return
                prompt, raw, cut = mix.plan(j, prompts, refs)
                send = raw_request(http, target, prompt, refs[prompt.index], cut, match) if raw else \
                    sdk_request(sdk, target, prompt, refs[prompt.index], cut, match)
                result = await send
                result.end = time.perf_counter()
                results.append(result)
                on_result(result)
                await asyncio.sleep(result.retry_after)

        await asyncio.gather(*(client() for _ in share))
        return results, time.perf_counter() - started


# ---- client processes: one level's clients spread over several ------------------------------

# auto: one asyncio process parsing ~4,500 SDK chunks/s (32 clients, H100 host) was saturated, and
# one with 8 clients at ~2,800 chunks/s read 0.92 CPU busy
CLIENTS_PER_PROCESS = 4
PROCESS_WAIT_S = 300.0  # how long anyone waits at a start or finish line for the others before it fails


def client_process_count(flag: int | Literal["auto"], concurrency: int, cpus: int | None = os.cpu_count()) -> int:
    """How many processes run a level's clients, never more than the clients. auto: enough that each
    runs at most CLIENTS_PER_PROCESS, on at most half the host's cores (the rest are the server's)."""
    if flag == "auto":
        flag = min(-(-concurrency // CLIENTS_PER_PROCESS), max(1, (cpus or 1) // 2))
    return min(flag, concurrency)


def client_shares(concurrency: int, processes: int) -> list[range]:
    """The client slots range(concurrency) cut into `processes` runs whose lengths differ by at most 1."""
    size, longer = divmod(concurrency, processes)
    bounds = [p * size + min(p, longer) for p in range(processes + 1)]
    return [range(low, high) for low, high in itertools.pairwise(bounds)]


def request_indices(share: range, concurrency: int, requests: int | None) -> Iterator[int]:
    """The requests j a share of the client slots sends: those with j % concurrency in it. So each run of
    `concurrency` consecutive requests (those in flight together, with distinct prompts) is split between
    the shares by their size, and request j gets the same Mix plan in whichever process sends it."""
    return (j for j in range(requests if requests is not None else sys.maxsize) if j % concurrency in share)


Phase = tuple[int | None, float | None]  # (requests, duration) as run_phase takes them


class LevelClients:
    """A level's clients, which run its phases (warm-up, timed) in turn: in this process as run_phase
    runs them, or spread over spawned processes (no fork of a process with an event loop and threads),
    each its client_shares share. The same processes run every phase, so the warm-up warms them too
    (a process's first requests through the SDK cost far more CPU than later ones).

    Before a phase, `at_start_line` returns once every process has its clients set up, so spawning and
    setting up is not part of it and usage can be sampled just before; `run` releases them together
    and returns (results, seconds) as run_phase: the results merged, the seconds from the release to
    the last one's end (each times itself from its release). After the last phase they wait at a
    finish line until the `with` is left, so usage sampled before that still sees them (their exit,
    some 0.3 CPU seconds each, is not part of the phase either)."""

    def __init__(self, processes: int, target: Target, prompts: list[Prompt], refs: list[Answer], concurrency: int,
                 mix: Mix, timeout: float, match: Match, phases: list[Phase]) -> None:
        self.level = (target, prompts, refs, concurrency, mix, timeout)  # run_phase's first arguments
        self.match, self.phases = match, iter(phases)
        self.workers: list[BaseProcess] = []
        if processes == 1:
            return
        context = multiprocessing.get_context("spawn")
        # ready: all are at a line (a start line, set up; or the finish line); go: released from a start line
        self.ready, self.go = context.Barrier(processes + 1), context.Barrier(processes + 1)
        self.outbox: Queue = context.Queue()
        self.workers = [context.Process(target=client_process, daemon=True,
                                        args=(self.level, match, share, phases, self.ready, self.go, self.outbox))
                        for share in client_shares(concurrency, processes)]
        for worker in self.workers:
            worker.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, error: type[BaseException] | None, *_: object) -> None:
        if self.workers and error is None:
            self.ready.wait(PROCESS_WAIT_S)  # the finish line
        for worker in self.workers:
            if error is not None:  # one may still be running, or waiting at a line
                worker.kill()
            worker.join()

    async def at_start_line(self) -> None:
        if self.workers:
            await self._pass(self.ready)

    async def run(self) -> tuple[list[Result], float]:
        requests, duration = next(self.phases)
        if not self.workers:
            return await run_phase(*self.level, requests, duration, match=self.match)
        await self._pass(self.go)
        done = await asyncio.to_thread(self._collect)
        return [result for results, _ in done for result in results], max(seconds for _, seconds in done)

    async def _pass(self, barrier: Barrier) -> None:
        try:
            await asyncio.to_thread(barrier.wait, PROCESS_WAIT_S)
        except threading.BrokenBarrierError:  # a process failed and broke it: raise with its traceback
            await asyncio.to_thread(self._collect)
            raise

    def _collect(self) -> list[tuple[list[Result], float]]:
        """Each process's (results, seconds) for this phase; raises if one failed."""
        done = []
        while len(done) < len(self.workers):
            try:
                outcome, failure = self.outbox.get(timeout=1.0)
            except queue.Empty:
                if failed := [worker.exitcode for worker in self.workers if worker.exitcode not in (None, 0)]:
                    raise RuntimeError(f"client processes exited with {failed}") from None
                continue
            if failure:
                raise RuntimeError(f"a client process failed:\n{failure}")
            done.append(outcome)
        return done


def client_process(level: tuple, match: Match, share: range, phases: list[Phase], ready: Barrier, go: Barrier,
                   outbox: Queue) -> None:
    """A client process's life: each phase with its share of the clients, set up, then held at the
    start line until all are and the parent releases them; ((results, seconds), "") sent back after
    each, or (None, its traceback) when it fails. Then the finish line (see LevelClients)."""
    def start_line() -> None:  # blocking is fine: nothing else runs in this process meanwhile
        ready.wait(PROCESS_WAIT_S)
        go.wait(PROCESS_WAIT_S)

    try:
        for requests, duration in phases:
            outcome = asyncio.run(run_phase(*level, requests, duration, match=match, share=share, ready=start_line))
            outbox.put((outcome, ""))
        ready.wait(PROCESS_WAIT_S)
    except Exception:
        outbox.put((None, traceback.format_exc()))
        ready.abort()  # the others, and the parent, stop waiting at a line
        go.abort()
        raise


# ---- report ---------------------------------------------------------------------------------


def distribution_ms(seconds: list[float]) -> dict:
    """Mean, median, std and percentiles in ms; percentiles interpolate linearly, as numpy's default does."""
    if not seconds:
        return {}
    ms = [s * 1000 for s in seconds]
    cuts = statistics.quantiles(ms, n=100, method="inclusive") if len(ms) > 1 else ms * 99
    return {"mean": statistics.fmean(ms), "median": statistics.median(ms), "std": statistics.pstdev(ms),
            "p90": cuts[89], "p99": cuts[98], "max": max(ms)}


def tpot(result: Result) -> float:
    """vLLM's per-request TPOT; 0 for a single-token answer (as its goodput counts it)."""
    return (result.latency - result.ttft) / (result.output_tokens - 1) if result.output_tokens > 1 else 0.0


def summarize(results: list[Result], seconds: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> dict:
    ok = [r for r in results if r.status == "ok" and not r.problems]
    output_tokens = sum(r.output_tokens for r in ok)
    input_tokens = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok if (slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms)
            and (slo_tpot_ms is None or tpot(r) * 1000 <= slo_tpot_ms)]
    wrong = [r for r in results if r.problems]
    return {
        "requests": len(results), "completed": len(ok), "duration_s": seconds,
        "status_counts": dict(Counter(r.status for r in results)),
        "via_counts": dict(Counter(r.via for r in results)),
        "wrong_answers": len(wrong),
        "wrong_examples": [{"prompt": r.prompt, "via": r.via, "problems": r.problems} for r in wrong[:5]],
        "connection_errors": [{"via": r.via, "error": r.error}
                              for r in results if r.status == "connection"][:20],
        "input_tokens": input_tokens, "output_tokens": output_tokens,
        "request_throughput": len(ok) / seconds, "output_throughput": output_tokens / seconds,
        "total_token_throughput": (input_tokens + output_tokens) / seconds,
        "goodput": len(good) / seconds if slo_ttft_ms is not None or slo_tpot_ms is not None else None,
        "ttft_ms": distribution_ms([r.ttft for r in ok]),
        "tpot_ms": distribution_ms([tpot(r) for r in ok if r.output_tokens > 1]),
        "itl_ms": distribution_ms([gap for r in ok for gap in r.itl]),
        "e2el_ms": distribution_ms([r.latency for r in ok]),
    }


def divergences(results: list[Result]) -> dict:
    """top5: right answers that left their reference's path within both top-5s, and where the first did."""
    accepted = [r for r in results if r.divergence is not None and not r.problems]
    return {"diverged_within_top5": len(accepted),
            "diverged_examples": [{"prompt": r.prompt, "via": r.via, **asdict(r.divergence)} for r in accepted[:5]]}


# ---- the server: its processes and its metrics ----------------------------------------------


def process_tree_usage(pid: int) -> dict:
    """RSS, open file descriptors and CPU seconds (user + system) of the server and everything it
    started (engine, resource tracker; with --api-server-count N its N API server processes, the ones
    listening on the port, and the supervisor that started them); the CPU seconds of this client too,
    which shares the host."""
    root = psutil.Process(pid)
    tree = [root, *root.children(recursive=True)]
    procs = []
    for proc in tree:
        try:
            cmd = " ".join(proc.cmdline())
            listens = any(c.status == psutil.CONN_LISTEN for c in proc.net_connections("tcp"))
            role = ("server" if listens else "supervisor" if proc.pid == pid else "engine" if "spawn_main" in cmd
                    else "resource_tracker" if "resource_tracker" in cmd else proc.name())
            cpu = proc.cpu_times()
            procs.append({"pid": proc.pid, "role": role, "rss_mb": proc.memory_info().rss / 2**20,
                          "fds": proc.num_fds(), "cpu_s": cpu.user + cpu.system})
        except psutil.NoSuchProcess:
            continue
    return {"at": time.time(), "rss_mb": sum(p["rss_mb"] for p in procs), "fds": sum(p["fds"] for p in procs),
            "processes": procs, "client_cpu_s": client_cpu_seconds({proc.pid for proc in tree})}


def client_cpu_seconds(server: set[int]) -> float:
    """CPU seconds (user + system) of this process and of all it started but the server's processes
    (a --spawn server is its child): the client processes, alive at both samples of a level's timed
    phase (see LevelClients)."""
    me = psutil.Process()
    own = me.cpu_times()
    seconds = own.user + own.system
    for child in me.children(recursive=True):
        try:
            if child.pid not in server:
                cpu = child.cpu_times()
                seconds += cpu.user + cpu.system
        except psutil.NoSuchProcess:
            continue
    return seconds


def cpu_busy(start: dict, end: dict) -> dict[str, float]:
    """Per role, CPU seconds per second of wall time between two usage samples, summed over the role's
    processes: near 1.0 a single-threaded process (an API server's event loop, a client process) is what
    limits the level, so "server_busiest" gives the busiest API server process alone. "client" is this
    process and its client processes together: near their count, they limit it."""
    wall = end["at"] - start["at"]
    before = {p["pid"]: p["cpu_s"] for p in start["processes"]}
    busy: dict[str, float] = {}
    for p in end["processes"]:
        if p["pid"] in before:
            seconds = (p["cpu_s"] - before[p["pid"]]) / wall
            busy[p["role"]] = busy.get(p["role"], 0.0) + seconds
            if p["role"] == "server":
                busy["server_busiest"] = max(busy.get("server_busiest", 0.0), seconds)
    return {**busy, "client": (end["client_cpu_s"] - start["client_cpu_s"]) / wall}


# histogram totals whose change over a level tells the server's side of it (server_view)
SERVER_TOTALS = ("moe_time_to_first_token_seconds_sum", "moe_time_to_first_token_seconds_count",
                 "moe_batch_size_sum", "moe_batch_size_count", "moe_batch_tokens_sum",
                 "moe_spec_verify_steps_total", "moe_spec_draft_tokens_total", "moe_spec_accepted_tokens_total")


async def engine_gauges(target: Target) -> dict[str, float]:
    """The /metrics samples this report needs: running/waiting gauges, finished requests by reason,
    and the SERVER_TOTALS."""
    async with httpx.AsyncClient(timeout=30) as http:
        text = (await http.get(f"{target.base_url}/metrics",
                               headers={"authorization": f"Bearer {target.api_key}"})).text
    samples = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if (name in ("moe_num_requests_running", "moe_num_requests_waiting", *SERVER_TOTALS)
                or name.startswith("moe_requests_total{")):
            samples[name] = float(value)
    return samples


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the server saw between two idle samples: mean TTFT from the request's arrival at the
    server (after parsing and templating) to its first token there, and the engine's steps and mean
    batch. Against the client's TTFT it tells time spent in the client and the HTTP path from time
    spent in the engine; a mean batch far below the concurrency means requests wait outside it."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in SERVER_TOTALS}
    requests, steps = delta["moe_time_to_first_token_seconds_count"], delta["moe_batch_size_count"]
    return {"ttft_mean_ms": 1e3 * delta["moe_time_to_first_token_seconds_sum"] / requests if requests else None,
            "steps": steps,
            "mean_batch_size": delta["moe_batch_size_sum"] / steps if steps else None,
            "mean_batch_tokens": delta["moe_batch_tokens_sum"] / steps if steps else None,
            # speculative rounds, one per sequence verified (0 without --spec)
            "spec_verify_rounds": delta["moe_spec_verify_steps_total"],
            "spec_acceptance": (delta["moe_spec_accepted_tokens_total"] / delta["moe_spec_draft_tokens_total"]
                                if delta["moe_spec_draft_tokens_total"] else None)}


async def wait_engine_idle(target: Target, timeout: float = 30.0) -> dict[str, float]:
    """Poll until the engine reports nothing running or waiting (snapshots come every 0.5 s)."""
    deadline = time.monotonic() + timeout
    while True:
        gauges = await engine_gauges(target)
        idle = gauges.get("moe_num_requests_running") == 0 and gauges.get("moe_num_requests_waiting") == 0
        if idle or time.monotonic() > deadline:
            return {**gauges, "idle": idle}
        await asyncio.sleep(0.25)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SpawnedServer:
    """`python -m moe_serve.server --model M --port FREE ...`, the project's own start command, logging to a file."""

    def __init__(self, model: str, server_args: list[str], log_path: Path, start_timeout: float = 300) -> None:
        self.base_url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "moe_serve.server", "--model", model, "--port", self.base_url.rsplit(":", 1)[1],
               *server_args]
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_healthy(start_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; see {self.log_path}")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout}s; see {self.log_path}")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, as an orchestrator stops it; the exit code goes into the report."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return -signal.SIGKILL


# ---- the whole run --------------------------------------------------------------------------


async def served_model(base_url: str, api_key: str) -> str:
    async with httpx.AsyncClient(timeout=30) as http:
        resp = await http.get(f"{base_url}/v1/models", headers={"authorization": f"Bearer {api_key}"})
    return resp.raise_for_status().json()["data"][0]["id"]


async def fetch_references(target: Target, prompts: list[Prompt], timeout: float,
                           match: Match = "exact") -> list[Answer]:
    async with clients(target, 1, timeout) as (sdk, _):
        return [await fetch_reference(sdk, target, p, match) for p in prompts]


async def sample_every(seconds: float, pid: int | None, samples: list[dict]) -> None:
    while pid is not None:
        await asyncio.sleep(seconds)
        samples.append(process_tree_usage(pid))


async def run_level(args: argparse.Namespace, target: Target, prompts: list[Prompt], refs: list[Answer],
                    concurrency: int, pid: int | None) -> dict:
    """Warm-up (untimed, verified), idle resource sample, timed phase, resource sample, idle engine."""
    mix = Mix(args.raw_fraction, args.disconnect_fraction, args.seed + concurrency)
    processes = client_process_count(args.client_processes, concurrency)
    phases = [(args.warmup if args.warmup is not None else concurrency, None), (args.requests, args.duration)]
    with LevelClients(processes, target, prompts, refs, concurrency, mix, args.timeout, args.match,
                      phases) as level_clients:
        await level_clients.at_start_line()
        warmup, _ = await level_clients.run()
        engine_before = await wait_engine_idle(target)
        await level_clients.at_start_line()
        start_usage = process_tree_usage(pid) if pid else None
        samples: list[dict] = []
        sampler = asyncio.ensure_future(sample_every(args.sample_every, pid, samples))
        try:
            results, seconds = await level_clients.run()
        finally:
            sampler.cancel()
        end_usage = process_tree_usage(pid) if pid else None  # before waiting: cpu_busy covers the timed phase
    engine_after = await wait_engine_idle(target)
    await asyncio.sleep(1.0)  # let the server close the connections this phase opened
    diverged = divergences if args.match == "top5" else lambda _: {}  # an exact report keeps its keys
    return {"concurrency": concurrency, "client_processes": processes,
            **summarize(results, seconds, args.slo_ttft, args.slo_tpot),
            **diverged(results),
            "warmup": {"requests": len(warmup), "status_counts": dict(Counter(r.status for r in warmup)),
                       "wrong_answers": sum(bool(r.problems) for r in warmup), **diverged(warmup)},
            "engine_after": engine_after, "server_view": server_view(engine_before, engine_after),
            "resources": {"start": start_usage, "end": end_usage, "samples": samples,
                          "cpu_busy": cpu_busy(start_usage, end_usage) if pid else None}}


def verdict(levels: list[dict], allowed: set[str]) -> dict:
    unexpected = Counter()
    for level in levels:
        for counts in (level["status_counts"], level["warmup"]["status_counts"]):
            unexpected.update({s: n for s, n in counts.items() if s not in allowed})
    wrong = sum(level["wrong_answers"] + level["warmup"]["wrong_answers"] for level in levels)
    idle = all(level["engine_after"]["idle"] for level in levels)
    return {"wrong_answers": wrong, "unexpected_errors": dict(unexpected), "engine_idle_after_each_level": idle,
            "passed": wrong == 0 and not unexpected and idle}


async def run(args: argparse.Namespace, base_url: str, pid: int | None) -> dict:
    model = args.served_model or await served_model(base_url, args.api_key)
    target = Target(base_url, model, args.api_key)
    prompts = make_prompts(args.num_prompts, args.prompt_words, args.max_tokens, args.range_ratio, args.seed)
    began = time.perf_counter()
    refs = await fetch_references(target, prompts, args.timeout, args.match)
    reference_seconds = time.perf_counter() - began
    levels = [await run_level(args, target, prompts, refs, c, pid) for c in args.concurrency]
    prompt_tokens = [r.prompt_tokens for r in refs]
    return {
        "config": {k: v for k, v in vars(args).items() if k != "api_key"},
        "model": model,
        "references": {"prompts": len(refs), "distinct_outputs": len({r.text for r in refs}),
                       "seconds": reference_seconds, "prompt_tokens": distribution_of(prompt_tokens),
                       "completion_tokens": distribution_of([r.completion_tokens for r in refs]),
                       "finish_reasons": dict(Counter(r.finish_reason for r in refs))},
        "levels": levels,
        "verdict": verdict(levels, {"ok", "disconnected", *args.allow_status}),
    }


def distribution_of(values: list[int]) -> dict:
    return {"min": min(values), "mean": sum(values) / len(values), "max": max(values)}


def client_processes_flag(text: str) -> int | Literal["auto"]:
    if text == "auto":
        return text
    if (count := int(text)) < 1:
        raise argparse.ArgumentTypeError("at least 1, or auto")
    return count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running server, e.g. http://127.0.0.1:8000")
    where.add_argument("--spawn", action="store_true", help="start `python -m moe_serve.server` on a free port")
    p.add_argument("--model", default=str(REPO / "moe_serve" / "models" / "default"), help="checkpoint for --spawn")
    p.add_argument("--server-args", default="", help="more moe-serve flags for --spawn, one string")
    p.add_argument("--server-log", default=None, help="--spawn: where the server's log goes")
    p.add_argument("--server-pid", type=int, default=None, help="with --base-url: sample this process tree")
    p.add_argument("--served-model", default=None, help="model name to send (default: GET /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("MOE_API_KEY", "unused"))
    p.add_argument("--num-prompts", type=int, default=64, help="distinct prompts, one reference each")
    p.add_argument("--prompt-words", type=int, default=24, help="mean prompt length in words")
    p.add_argument("--max-tokens", type=int, default=32, help="mean max_tokens")
    p.add_argument("--range-ratio", type=float, default=0.5, help="lengths uniform in mean*(1 +- ratio)")
    p.add_argument("--concurrency", type=lambda s: [int(c) for c in s.split(",")], default=[1, 8, 64])
    run_for = p.add_mutually_exclusive_group()
    run_for.add_argument("--requests", type=int, default=None, help="timed requests per level")
    run_for.add_argument("--duration", type=float, default=None, help="timed seconds per level")
    p.add_argument("--warmup", type=int, default=None, help="untimed requests per level (default: concurrency)")
    p.add_argument("--raw-fraction", type=float, default=0.1, help="share sent over raw httpx ([DONE] check)")
    p.add_argument("--disconnect-fraction", type=float, default=0.0, help="share that hang up mid-stream")
    p.add_argument("--allow-status", default=[], type=lambda s: s.split(","),
                   help="statuses that are expected, e.g. 429 when --max-queue is below the concurrency")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, ms")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on TPOT, ms")
    p.add_argument("--match", choices=MATCHES, default="exact",
                   help="exact: each answer equals its reference (CPU fp32); top5: vLLM's check_logprobs_close, "
                        "equal up to the first divergence and there each token in the other's top-5 "
                        "(bf16 on a GPU with batching)")
    p.add_argument("--client-processes", type=client_processes_flag, default="auto",
                   help="processes that run a level's clients, each its share: auto = enough that each runs "
                        f"at most {CLIENTS_PER_PROCESS}, on at most half the cores; 1 = all in this one")
    p.add_argument("--timeout", type=float, default=300.0, help="per-request client timeout, s")
    p.add_argument("--sample-every", type=float, default=10.0, help="resource samples during a level, s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    if args.requests is None and args.duration is None:
        args.requests = 100
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    server = None
    if args.spawn:
        log = Path(args.server_log or tempfile.mkstemp(prefix="moe-serve-", suffix=".log")[1])
        server = SpawnedServer(args.model, shlex.split(args.server_args), log)
    try:
        base_url = server.base_url if server else args.base_url.rstrip("/")
        pid = server.process.pid if server else args.server_pid
        report = asyncio.run(run(args, base_url, pid))
    finally:
        exit_code = server.stop() if server else None
    if server:
        report["server"] = {"log": str(server.log_path), "exit_code_after_sigterm": exit_code}
        report["verdict"]["passed"] &= exit_code == 0
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    shown = ("concurrency", "requests", "status_counts", "wrong_answers", "request_throughput", "output_throughput")
    shown += ("diverged_within_top5",) if args.match == "top5" else ()
    print(json.dumps({"levels": [{k: lvl[k] for k in shown} for lvl in report["levels"]],
                      "verdict": report["verdict"]}, indent=1))
    return 0 if report["verdict"]["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
