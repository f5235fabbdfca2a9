"""EngineCore: take new requests -> schedule -> step (one batched forward, or draft/verify) -> outputs.

The scheduler (moe_serve/engine/scheduler.py) picks which chunks of which sequences run in a step, and
every scheduled sequence runs in ONE forward over the paged KV cache (moe_serve/engine/model_runner.py),
so the tokens of all of them share each expert copy. With --spec, a step whose decoding sequences
have no grammar drafts and verifies instead while that is measured to pay for its batch size
(moe_serve/engine/speculative/switch.py); several sequences speculate as one batch over the paged
cache (moe_serve/engine/speculative/batched.py), the step's prefill chunks riding in the verify
forward. A sequence decoding alone runs the lone decoder, which also prefetches the verify pass's
experts from the draft's predictions: its KV moves from the paged cache into that decoder's
one-sequence cache and its new positions move back after each round, so the next batched step
finds it where it left off.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.messages import EngineReady, GenerateRequest, MetricsSnapshot, RequestOutput
from moe_serve.engine.model_runner import ChunkResult
from moe_serve.engine.runtime import Runtime, build_runtime
from moe_serve.engine.scheduler import ScheduledChunk, Scheduler
from moe_serve.engine.sampling import draft_verify_honours
from moe_serve.engine.sequence import Sequence
from moe_serve.engine.speculative.switch import SpecSwitch
from moe_serve.engine.structured import Grammars


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runtime: Runtime = build_runtime(config)
        self.scheduler = Scheduler(self.runtime.scheduler_config)
        self.tpot_samples: list[float] = []
        self.batch_samples: list[tuple[int, int]] = []  # (sequences, tokens) per step since the last snapshot
        self.spec_switch = SpecSwitch(always=config.spec_switch == "always")
        self._speculating: Sequence | None = None  # the sequence the speculative decoder's caches hold
        self.grammars = Grammars.of_checkpoint(config.tokenizer_path, self.runtime.model_config.vocab_size,
                                               config.trust_remote_code)

    def ready_info(self) -> EngineReady:
        return EngineReady(
            model_name=self.config.model,
            max_model_len=self.runtime.max_model_len,
            vocab_size=self.runtime.model_config.vocab_size,
            settings=self.runtime.describe(),
        )

    def add_request(self, request: GenerateRequest) -> RequestOutput | None:
        """Queue a request; a request the engine cannot take is answered at once with its error."""
        seq = Sequence.from_request(request)
        vocab = self.runtime.model_config.vocab_size
        try:
            if any(not 0 <= t < vocab for t in seq.prompt_ids):
                raise ValueError(f"prompt token ids must be in [0, {vocab})")
            if request.params.structured is not None:
                seq.grammar = self.grammars.matcher(request.params.structured)
            self.scheduler.add(seq)
        except ValueError as exc:
            seq.finish_reason = "error"
            return self._output(seq, error=str(exc))
        return None

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its KV at once; returns its final output if it was known."""
        seq = self.scheduler.find(request_id)
        if seq is None:
            return None
        self.scheduler.finish(seq)
        seq.finish_reason = "abort"
        return self._output(seq)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled.chunks:
            return []
        self.batch_samples.append((len(scheduled.chunks), scheduled.num_tokens))
        started = time.perf_counter()
        decoding = [c.seq for c in scheduled.chunks if c.seq.output_ids and c.samples]  # not a prefill
        before = {id(s): len(s.output_ids) for s in decoding}
        riders = [c for c in scheduled.chunks if id(c.seq) not in before]  # prefill chunks
        could = self._could_speculate(scheduled.chunks, decoding, riders)
        # with prefill chunks riding along, the step would spoil the switch's measurements: it follows
        # the bucket's current mode (and is recorded as a step that could not speculate)
        speculate = (could and (self.spec_switch.prefers(len(decoding)) if riders
                                else self.spec_switch.speculate(len(decoding)))
                     and self._reserve_drafts(decoding, riders))
        if not speculate:
            outputs = self._batched_step(scheduled.chunks)
        elif len(decoding) == 1 and not riders:
            outputs = self._speculative_step(decoding[0])
        else:
            outputs = self._batched_speculative_step(scheduled.chunks, decoding, riders)
        elapsed = time.perf_counter() - started
        produced = [len(seq.output_ids) - before[id(seq)] for seq in decoding]
        for count in produced:  # a prefill's token counts for TTFT, not TPOT
            # (none: a grammar completed a step earlier, structured.GrammarMatcher)
            self.tpot_samples.extend([elapsed / count] * count if count else ())
        self.spec_switch.record(len(decoding) if could and not riders else None, speculate, elapsed, sum(produced))
        return outputs

    def _could_speculate(self, chunks: list[ScheduledChunk], decoding: list[Sequence],
                         riders: list[ScheduledChunk]) -> bool:
        """Every decoding sequence may speculate: its sampling is one draft/verify honours and no
        grammar constrains it (a draft would need the grammar's mask at every position). A lone sequence
        moves into the lone decoder's cache, so only with nothing else running or waiting; a batch's
        verify pass, with the prefill chunks (riders) it carries, must fit the step's token budget."""
        if self.runtime.decoder is None or not decoding:
            return False
        if not all(s.grammar is None and draft_verify_honours(s.params, len(s.output_ids)) for s in decoding):
            return False
        if len(chunks) == 1:
            return len(self.scheduler.running) == 1 and not self.scheduler.waiting
        verify_tokens = len(decoding) * (self.config.spec_tokens + 1) + sum(c.num_tokens for c in riders)
        speculating = {id(s) for s in decoding}
        return (all(c.num_tokens == 1 for c in chunks if id(c.seq) in speculating)
                and verify_tokens <= self.scheduler.config.max_num_batched_tokens)

    def _reserve_drafts(self, decoding: list[Sequence], riders: list[ScheduledChunk]) -> bool:
        """KV blocks for every position a batch's round may write; when they are short, decode plainly."""
        if len(decoding) == 1 and not riders:
            return True  # the lone decoder writes its own cache; the blocks grow after the round
        speculator = self.runtime.speculator
        return self.scheduler.reserve([(s, speculator.positions_needed(s, self.runtime.max_model_len))
                                       for s in decoding])

    def _batched_step(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        """One forward for every chunk. If it fails, each chunk is retried alone, so only the
        request that fails by itself gets the error and the others go on."""
        try:
            results, _ = self.runtime.batch_runner.execute(chunks)
        except Exception as exc:  # a failing request must not take the engine or its batch down
            if len(chunks) > 1:
                return [out for chunk in chunks for out in self._batched_step([chunk])]
            return [self._fail(chunks[0].seq, exc)]
        finally:
            self.runtime.finish_step()
        return self._chunks_done(chunks, results)

    def _chunks_done(self, chunks: list[ScheduledChunk], results: list[ChunkResult]) -> list[RequestOutput]:
        """The computed chunks' progress, prompt logprobs and sampled tokens, into their sequences."""
        outputs = []
        for chunk, result in zip(chunks, results):
            self.scheduler.advance(chunk)
            seq, sampled = chunk.seq, result.sampled
            seq.prompt_logprobs.extend(result.prompt_logprobs)
            if sampled is None:
                continue
            if seq.append(sampled.token, sampled.logprob, self.runtime.max_model_len):
                self.scheduler.finish(seq)
            outputs.append(self._output(seq))
        return outputs

    def _batched_speculative_step(self, chunks: list[ScheduledChunk], seqs: list[Sequence],
                                  riders: list[ScheduledChunk]) -> list[RequestOutput]:
        """One draft/verify round of decoding sequences over the paged cache, the prefill chunks
        riding in its verify forward. If a forward fails, no sequence has changed yet: the step
        decodes plainly, each request failing alone."""
        max_len = self.runtime.max_model_len
        try:
            verified, results = self.runtime.speculator.draft_and_verify(seqs, max_len, riders)
        except Exception:  # a failing request must not take its batch down: the plain step isolates it
            self.runtime.finish_step()
            return self._batched_step(chunks)
        self.runtime.finish_step()
        self.runtime.speculator.accept(verified, max_len)
        for seq in seqs:
            if seq.is_finished:
                self.scheduler.finish(seq)
        return [self._output(seq) for seq in seqs] + self._chunks_done(riders, results)

    def _speculative_step(self, seq: Sequence) -> list[RequestOutput]:
        """One draft/verify round of a sequence decoding alone, over the decoder's own caches."""
        target, paged = self.runtime.target.kv, self.runtime.batch_runner.cache
        if self._speculating is not seq:
            self.runtime.decoder.reset()  # another sequence's caches: start over (a draft catches up by itself)
            self._speculating = seq
        computed = seq.num_computed_tokens
        target.truncate(min(target.length, computed))
        paged.copy_to(target, seq.block_table, target.length, computed)  # what batched steps computed meanwhile
        target.length = computed
        try:
            self.runtime.decoder.step(seq, self.runtime.max_model_len)
        except Exception as exc:  # a failing request must not take the engine down with it
            self._speculating = None
            return [self._fail(seq, exc)]
        finally:
            self.runtime.finish_step()
        seq.num_computed_tokens = target.length  # all of its tokens but the pending one
        if seq.is_finished:
            self.scheduler.finish(seq)
            self._speculating = None
        else:  # alone with nothing waiting, so the blocks are free
            self.scheduler.blocks.grow(seq, seq.num_computed_tokens)
            paged.copy_from(target, seq.block_table, computed, seq.num_computed_tokens)
        return [self._output(seq)]

    def _fail(self, seq: Sequence, exc: Exception) -> RequestOutput:
        self.scheduler.finish(seq)
        seq.finish_reason = "error"
        return self._output(seq, error=f"{type(exc).__name__}: {exc}")

    def _output(self, seq: Sequence, error: str | None = None) -> RequestOutput:
        new_ids = tuple(seq.output_ids[seq.emitted :])
        new_logprobs = tuple(seq.logprobs[seq.emitted :])
        first = seq.emitted == 0 and bool(new_ids)
        seq.emitted = len(seq.output_ids)
        new_prompt_logprobs = tuple(seq.prompt_logprobs[seq.emitted_prompt_logprobs:])
        seq.emitted_prompt_logprobs = len(seq.prompt_logprobs)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=new_ids,
            logprobs=new_logprobs,
            prompt_logprobs=new_prompt_logprobs,
            finish_reason=seq.finish_reason,
            error=error,
            prompt_tokens=len(seq.prompt_ids),
            first_token_seconds=(seq.first_token_time - seq.arrival_time) if first and seq.first_token_time else None,
        )

    def metrics_snapshot(self) -> MetricsSnapshot:
        samples, self.tpot_samples = tuple(self.tpot_samples), []
        batches, self.batch_samples = self.batch_samples, []
        snapshot = self.runtime.metrics_snapshot(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting), tpot_samples=samples
        )
        return replace(snapshot, batch_size_samples=tuple(b for b, _ in batches),
                       batch_token_samples=tuple(t for _, t in batches), preemptions=self.scheduler.num_preemptions,
                       kv_cache_usage=self.scheduler.blocks.usage)

    def close(self) -> None:
        self.grammars.close()
        self.runtime.close()


@dataclass
class Completion:
    token_ids: list[int]
    finish_reason: str | None
    ttft_seconds: float | None
    tpot_seconds: float | None  # (last token time - first token time) / (tokens - 1)


def run_to_completion(core: EngineCore, request: GenerateRequest) -> Completion:
    """Drive one request through the engine alone (CLI, benchmarks); raises on an engine error."""
    rejected = core.add_request(request)
    if rejected is not None:
        raise RuntimeError(rejected.error)
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
