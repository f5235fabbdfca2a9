"""moe_serve/engine/process.py on its own: the message protocol of a spawned engine process."""
from __future__ import annotations

import multiprocessing as mp
import queue
from pathlib import Path

import pytest

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.messages import (
    AbortRequest,
    EngineFailed,
    EngineReady,
    GenerateRequest,
    MetricsSnapshot,
    RequestOutput,
    SamplingParams,
    Shutdown,
    StepOutputs,
)
from moe_serve.engine.process import run_engine


@pytest.fixture
def spawn(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # see conftest.start_server
    ctx = mp.get_context("spawn")
    started = []

    def start(config: EngineConfig) -> tuple[mp.Queue, mp.Queue, mp.process.BaseProcess]:
        inbox, outbox = ctx.Queue(), ctx.Queue()
        process = ctx.Process(target=run_engine, args=(config, inbox, outbox))
        process.start()
        started.append(process)
        return inbox, outbox, process

    yield start
    for process in started:
        process.kill()
        process.join()


def _until(outbox: mp.Queue, predicate, seen: list) -> object:
    """Read messages (a StepOutputs as its RequestOutputs, in order) until one satisfies predicate."""
    while True:
        message = outbox.get(timeout=60)
        assert not isinstance(message, RequestOutput), "outputs travel in StepOutputs, one message per step"
        for item in message.outputs if isinstance(message, StepOutputs) else (message,):
            seen.append(item)
            if predicate(item):
                return item


def test_generate_abort_snapshot_shutdown(spawn, tiny_model: Path) -> None:
    inbox, outbox, process = spawn(EngineConfig(model=str(tiny_model), max_model_len=256))
    ready = outbox.get(timeout=120)
    assert isinstance(ready, EngineReady) and ready.vocab_size == 128 and ready.max_model_len == 256
    inbox.put(GenerateRequest("short", (1, 5, 6), SamplingParams(max_tokens=5, temperature=0)))
    inbox.put(GenerateRequest("long", (1, 5, 6), SamplingParams(max_tokens=200, temperature=0)))
    seen: list = []

    def finished(rid: str):
        return lambda m: isinstance(m, RequestOutput) and m.request_id == rid and m.finish_reason is not None

    short = _until(outbox, finished("short"), seen)
    tokens = [t for m in seen if isinstance(m, RequestOutput) and m.request_id == "short" for t in m.new_token_ids]
    assert (short.finish_reason, len(tokens)) == ("length", 5) or (short.finish_reason == "stop" and len(tokens) <= 5)
    _until(outbox, lambda m: isinstance(m, RequestOutput) and m.request_id == "long" and m.new_token_ids, seen)
    inbox.put(AbortRequest("long"))
    aborted = _until(outbox, finished("long"), seen)
    assert aborted.finish_reason == "abort"
    long_tokens = sum(len(m.new_token_ids) for m in seen if isinstance(m, RequestOutput) and m.request_id == "long")
    assert long_tokens < 200
    idle = _until(outbox, lambda m: isinstance(m, MetricsSnapshot) and m.num_running == 0 and m.num_waiting == 0, [])
    assert len(idle.cache_hits_per_layer) == 3  # one entry per MoE layer of the tiny checkpoint
    inbox.put(Shutdown())
    process.join(30)
    assert process.exitcode == 0


def test_engine_that_cannot_load_says_why(spawn, tmp_path: Path) -> None:
    _, outbox, process = spawn(EngineConfig(model=str(tmp_path / "missing")))
    failed = outbox.get(timeout=120)
    assert isinstance(failed, EngineFailed) and "missing" in failed.message
    process.join(30)
    assert process.exitcode == 0
    with pytest.raises(queue.Empty):
        outbox.get(timeout=0.5)


def test_one_message_per_step(spawn, tiny_model: Path) -> None:
    """Each pass of the engine loop sends its outputs together: requests that share steps share
    messages, a request appears at most once in each, and a rejection rides in the same kind of message."""
    inbox, outbox, process = spawn(EngineConfig(model=str(tiny_model), max_model_len=256))
    # queued before the engine loop starts, so its first pass takes all of them
    for rid in ("a", "b", "c"):
        inbox.put(GenerateRequest(rid, (1, 5, 6), SamplingParams(max_tokens=6, temperature=0)))
    inbox.put(GenerateRequest("bad", (1, 10_000), SamplingParams(max_tokens=6)))
    assert isinstance(outbox.get(timeout=120), EngineReady)
    steps: list[StepOutputs] = []
    finished: set[str] = set()
    while finished != {"a", "b", "c", "bad"}:
        message = outbox.get(timeout=60)
        if isinstance(message, MetricsSnapshot):
            continue
        assert isinstance(message, StepOutputs)
        steps.append(message)
        ids = [o.request_id for o in message.outputs]
        assert len(ids) == len(set(ids))
        finished |= {o.request_id for o in message.outputs if o.finish_reason is not None}
    first = {o.request_id: o for o in steps[0].outputs}
    assert first["bad"].finish_reason == "error" and "prompt token ids" in first["bad"].error
    assert {"a", "b", "c"} <= set(first) and all(len(first[r].new_token_ids) == 1 for r in "abc")
    tokens = {r: [t for s in steps for o in s.outputs if o.request_id == r for t in o.new_token_ids] for r in "abc"}
    assert tokens["a"] == tokens["b"] == tokens["c"]  # same prompt, greedy
    assert len(tokens["a"]) == 6 and len(steps) == 6  # one message per step, not one per sequence
    inbox.put(Shutdown())
    process.join(30)
    assert process.exitcode == 0
