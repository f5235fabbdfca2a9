"""EngineCore: take new requests -> schedule -> step (decode or draft/verify) -> outputs.

Scheduling is first-come first-served, one running sequence at a time: the KV cache and the
expert cache serve a single sequence, which is what bs=1 offloaded decoding wants.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.messages import EngineReady, GenerateRequest, MetricsSnapshot, RequestOutput
from engine.runtime import Runtime, build_runtime
from engine.sequence import Sequence


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runtime: Runtime = build_runtime(config)
        self.waiting: deque[Sequence] = deque()
        self.running: Sequence | None = None
        self.tpot_samples: list[float] = []

    def ready_info(self) -> EngineReady:
        return EngineReady(
            model_name=self.config.model,
            max_model_len=self.runtime.max_model_len,
            vocab_size=self.runtime.model_config.vocab_size,
            settings=self.runtime.describe(),
        )

    def add_request(self, request: GenerateRequest) -> None:
        self.waiting.append(Sequence.from_request(request))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request; returns its final output if it was known."""
        if self.running is not None and self.running.request_id == request_id:
            seq, self.running = self.running, None
        else:
            seq = next((s for s in self.waiting if s.request_id == request_id), None)
            if seq is None:
                return None
            self.waiting.remove(seq)
        seq.finish_reason = "abort"
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.running is not None or bool(self.waiting)

    def step(self) -> list[RequestOutput]:
        if self.running is None:
            if not self.waiting:
                return []
            self.running = self.waiting.popleft()
            self.runtime.decoder.reset()
        seq = self.running
        started = time.perf_counter()
        before = len(seq.output_ids)
        try:
            self.runtime.decoder.step(seq, self.runtime.max_model_len)
        except Exception as exc:  # a failing request must not take the engine down with it
            self.running = None
            seq.finish_reason = "error"
            return [self._output(seq, error=f"{type(exc).__name__}: {exc}")]
        finally:
            self.runtime.finish_step()
        produced = len(seq.output_ids) - before
        if before > 0 and produced > 0:  # the first step is the prefill: it counts for TTFT, not TPOT
            self.tpot_samples.extend([(time.perf_counter() - started) / produced] * produced)
        if seq.finish_reason is not None:
            self.running = None
        return [self._output(seq)]

    def _output(self, seq: Sequence, error: str | None = None) -> RequestOutput:
        new_ids = tuple(seq.output_ids[seq.emitted :])
        new_logprobs = tuple(seq.logprobs[seq.emitted :])
        first = seq.emitted == 0 and bool(new_ids)
        seq.emitted = len(seq.output_ids)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            logprobs=new_logprobs,
            finish_reason=seq.finish_reason,
            error=error,
            prompt_tokens=len(seq.prompt_ids),
            first_token_seconds=(seq.first_token_time - seq.arrival_time) if first and seq.first_token_time else None,
        )

    def metrics_snapshot(self) -> MetricsSnapshot:
        samples, self.tpot_samples = tuple(self.tpot_samples), []
        return self.runtime.metrics_snapshot(
            num_running=int(self.running is not None), num_waiting=len(self.waiting), tpot_samples=samples
        )

    def close(self) -> None:
        self.runtime.close()


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None
    ttft_seconds: float | None
    tpot_seconds: float | None  # (last token time - first token time) / (tokens - 1)


def run_to_completion(core: EngineCore, request: GenerateRequest) -> Completion:
    """Drive one request through the engine alone (CLI, benchmarks); raises on an engine error."""
    core.add_request(request)
    token_ids: list[int] = []
    ttft = first_at = last_at = None
    finish = None
    while core.has_unfinished():
        for out in core.step():
            if out.error:
                raise RuntimeError(out.error)
            if out.new_token_ids:
                last_at = time.perf_counter()
                first_at = first_at or last_at
            ttft = out.first_token_seconds if ttft is None else ttft
            token_ids.extend(out.new_token_ids)
            finish = out.finish_reason or finish
    tpot = (last_at - first_at) / (len(token_ids) - 1) if len(token_ids) > 1 else None
    return Completion(token_ids, finish, ttft, tpot)
