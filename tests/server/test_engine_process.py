"""moe_serve/engine/process.py on its own: the message protocol of a spawned engine process over its
channels (one per API server process)."""
from __future__ import annotations

import multiprocessing as mp
from ctypes import c_bool
from pathlib import Path

import pytest

from moe_serve.engine.channel import Channel, ChannelListener, channel_addresses
from moe_serve.engine.config import EngineConfig
from moe_serve.engine.messages import (
    AbortRequest,
    EngineFailed,
    EngineReady,
    GenerateRequest,
    MetricsSnapshot,
    RequestOutput,
    SamplingParams,
    StepOutputs,
)
from moe_serve.engine.process import START_FAILED_EXIT_CODE, run_engine


@pytest.fixture
def spawn(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # see conftest.start_server
    ctx = mp.get_context("spawn")
    started, listeners = [], []

    def start(config: EngineConfig, api_servers: int = 1) -> tuple[list[Channel], mp.process.BaseProcess]:
        addresses = channel_addresses(api_servers)
        listeners.extend(ChannelListener(address) for address in addresses)
        process = ctx.Process(target=run_engine, args=(config, addresses, ctx.RawValue(c_bool, False)))
        process.start()
        started.append(process)
        return [_accept(listener) for listener in listeners[-api_servers:]], process

    yield start
    for process in started:
        process.kill()
        process.join()
    for listener in listeners:
        listener.close()


def _accept(listener: ChannelListener) -> Channel:
    channel = listener.accept(timeout=60)
    assert channel is not None, "the engine did not connect"
    return channel


def _get(channel: Channel, timeout: float = 60) -> object:
    assert channel.poll(timeout), "no message in time"
    return channel.recv()


def _until(channel: Channel, predicate, seen: list) -> object:
    """Read messages (a StepOutputs as its RequestOutputs, in order) until one satisfies predicate."""
    while True:
        message = _get(channel)
        assert not isinstance(message, RequestOutput), "outputs travel in StepOutputs, one message per step"
        for item in message.outputs if isinstance(message, StepOutputs) else (message,):
            seen.append(item)
            if predicate(item):
                return item


def finished(rid: str):
    return lambda m: isinstance(m, RequestOutput) and m.request_id == rid and m.finish_reason is not None


def test_generate_abort_snapshot_shutdown(spawn, tiny_model: Path) -> None:
    [channel], process = spawn(EngineConfig(model=str(tiny_model), max_model_len=256))
    ready = _get(channel, 120)
    assert isinstance(ready, EngineReady) and ready.vocab_size == 128 and ready.max_model_len == 256
    channel.send(GenerateRequest("short", (1, 5, 6), SamplingParams(max_tokens=5, temperature=0)))
    channel.send(GenerateRequest("long", (1, 5, 6), SamplingParams(max_tokens=200, temperature=0)))
    seen: list = []
    short = _until(channel, finished("short"), seen)
    tokens = [t for m in seen if isinstance(m, RequestOutput) and m.request_id == "short" for t in m.new_token_ids]
    assert (short.finish_reason, len(tokens)) == ("length", 5) or (short.finish_reason == "stop" and len(tokens) <= 5)
    _until(channel, lambda m: isinstance(m, RequestOutput) and m.request_id == "long" and m.new_token_ids, seen)
    channel.send(AbortRequest("long"))
    aborted = _until(channel, finished("long"), seen)
    assert aborted.finish_reason == "abort"
    long_tokens = sum(len(m.new_token_ids) for m in seen if isinstance(m, RequestOutput) and m.request_id == "long")
    assert long_tokens < 200
    idle = _until(channel, lambda m: isinstance(m, MetricsSnapshot) and m.num_running == 0 and m.num_waiting == 0, [])
    assert len(idle.cache_hits_per_layer) == 3  # one entry per MoE layer of the tiny checkpoint
    channel.close()  # the API server hangs up: the engine, serving no other, exits
    process.join(30)
    assert process.exitcode == 0


def test_engine_that_cannot_load_says_why(spawn, tmp_path: Path) -> None:
    [channel], process = spawn(EngineConfig(model=str(tmp_path / "missing")))
    failed = _get(channel, 120)
    assert isinstance(failed, EngineFailed) and "missing" in failed.message
    process.join(30)
    assert process.exitcode == START_FAILED_EXIT_CODE  # its supervisor does not start it again
    with pytest.raises(EOFError):
        _get(channel, 5)


def test_one_message_per_step(spawn, tiny_model: Path) -> None:
    """Each pass of the engine loop sends its outputs together: requests that share steps share
    messages, a request appears at most once in each, and a rejection rides in the same kind of message."""
    [channel], process = spawn(EngineConfig(model=str(tiny_model), max_model_len=256))
    # queued before the engine loop starts, so its first pass takes all of them
    for rid in ("a", "b", "c"):
        channel.send(GenerateRequest(rid, (1, 5, 6), SamplingParams(max_tokens=6, temperature=0)))
    channel.send(GenerateRequest("bad", (1, 10_000), SamplingParams(max_tokens=6)))
    assert isinstance(_get(channel, 120), EngineReady)
    steps: list[StepOutputs] = []
    finished: set[str] = set()
    while finished != {"a", "b", "c", "bad"}:
        message = _get(channel)
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
    channel.close()  # the API server hangs up: the engine, serving no other, exits
    process.join(30)
    assert process.exitcode == 0


def test_each_api_server_gets_its_own_outputs(spawn, tiny_model: Path) -> None:
    """Two API processes' requests share the engine's steps, but each output goes back on the channel its
    request came from; both hear every snapshot, only the first its samples (their histograms add up)."""
    channels, process = spawn(EngineConfig(model=str(tiny_model), max_model_len=256), api_servers=2)
    for name, channel in zip("xy", channels):
        channel.send(GenerateRequest(name, (1, 5, 6), SamplingParams(max_tokens=8, temperature=0)))
    seen: dict[str, list] = {"x": [], "y": []}
    for name, channel in zip("xy", channels):
        assert isinstance(_get(channel, 120), EngineReady)
        _until(channel, finished(name), seen[name])
    for name, other in (("x", "y"), ("y", "x")):
        outputs = [m for m in seen[name] if isinstance(m, RequestOutput)]
        assert {m.request_id for m in outputs} == {name}
    tokens = {n: [t for m in seen[n] if isinstance(m, RequestOutput) for t in m.new_token_ids] for n in "xy"}
    assert tokens["x"] == tokens["y"] and len(tokens["x"]) == 8
    first = _until(channels[0], lambda m: isinstance(m, MetricsSnapshot) and m.batch_size_samples, [])
    assert max(first.batch_size_samples) == 2  # one step carried both API processes' sequences
    second = _until(channels[1], lambda m: isinstance(m, MetricsSnapshot), [])
    assert second.batch_size_samples == () and second.tpot_samples == ()
    channels[1].send(GenerateRequest("gone", (1, 5, 6), SamplingParams(max_tokens=200, temperature=0)))
    channels[1].close()  # that API server went away: its request is aborted, the other is still served
    channels[0].send(GenerateRequest("z", (1, 5, 6), SamplingParams(max_tokens=3, temperature=0)))
    _until(channels[0], finished("z"), [])
    idle = _until(channels[0], lambda m: isinstance(m, MetricsSnapshot) and m.num_running == 0, [])
    assert idle.num_waiting == 0
    channels[0].close()  # the last one hangs up: the engine exits
    process.join(30)
    assert process.exitcode == 0
