"""Constrained decoding: a StructuredOutput compiled by llguidance, one matcher per sequence, one
bitmask per step for the batch, filled on the host once the forward is queued.

llguidance (vLLM's `guidance` backend) compiles JSON schemas, regexes, choices and Lark grammars
against the tokenizer lazily, computes a row's mask in tens of microseconds and has no heavy
dependencies (xgrammar, the alternative, pulls in Triton). The server checks every grammar with
the same `Grammars.check` before submitting, so a bad one is a 400 and the engine only compiles
valid ones; a failure that still happens here fails its own sequence, never its batch.

A row's mask allows the tokens that keep the text a prefix of the language; once the text is a
complete sentence llguidance also allows the tokenizer's EOS, and once nothing can follow, only
EOS: the sequence then finishes ("stop") at the token that completed it, the EOS never emitted.
(A step's tokens are consumed after the next step's forward is queued, on a worker thread while the
engine goes on from 4 constrained rows, so the engine learns of the completion one step later: that
step's token is dropped.)
"""
from __future__ import annotations

import _thread
import json
import queue
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import llguidance
import llguidance.hf
import torch

from moe_serve.engine.messages import StructuredOutput
from moe_serve.engine.token_mask import TokenMask

# JSON without optional whitespace (',' and ':' separators): a model cannot stall in an endless
# run of blanks, and a schema's "x-guidance" options still override this.
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A StructuredOutput that does not compile, or a matcher that reached an error state."""


def grammar_text(structured: StructuredOutput) -> str:
    """The llguidance grammar (a JSON document) for a StructuredOutput; GrammarError if malformed."""
    try:
        if structured.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(structured.spec, defaults=_JSON_OPTIONS)
        if structured.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=_JSON_OPTIONS)
        if structured.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(structured.spec)
        if structured.kind == "choice":
            return llguidance.LLMatcher.grammar_from_lark(_choice_lark(structured.spec))
        if structured.kind == "grammar":
            return llguidance.LLMatcher.grammar_from_lark(structured.spec)
    except ValueError as exc:  # llguidance's word for a spec that is not JSON
        raise GrammarError(str(exc)) from exc
    raise GrammarError(f"unknown structured output kind {structured.kind!r}")


def _choice_lark(spec: str) -> str:
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise GrammarError("a choice needs a non-empty list of strings")
    return "start: " + " | ".join(json.dumps(c) for c in choices)  # Lark's string literals are JSON's


class GrammarMatcher:
    """One sequence's position in its grammar (MaskFiller reads its mask), advanced by each sampled token.

    The batched runner hands a step's tokens to MaskFiller.follow, whose job consumes them with the
    next step's fill (on the FillWorker, or once that step's forward is queued). So the engine learns
    that a grammar completed one step late: Sequence.append then drops the token sampled after it
    (the mask allowed only EOS) and finishes the sequence as it would have at the completing token.
    A token the grammar refuses (only possible if the mask was bypassed) puts the matcher in its
    error state, which the sequence's next fill reports."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's: the width of this matcher's mask
        self.consumed = 0  # tokens llguidance consumed (written by whichever thread consumes them)
        self.complete_at: int | None = None  # `consumed` when nothing but EOS could follow any more
        self.job: PendingMasks | None = None  # the follow job consuming this matcher's last token
        self.failure: BaseException | None = None  # a follow job's consume that raised

    def consumed_one(self, accepted: bool, stopped: bool) -> None:
        """Count a token llguidance consumed (accepted: not refused), noting when the grammar completed
        (stopped: the matcher's is_stopped() after it)."""
        self.consumed += 1
        if accepted and stopped and self.complete_at is None:
            self.complete_at = self.consumed

    def settle(self) -> None:
        """Wait until every queued token is consumed."""
        if self.job is not None:
            self.job.wait_advanced()
            self.job = None

    def complete_within(self, tokens: int) -> bool:
        """Whether the grammar was complete after the first `tokens` output tokens (those must be consumed)."""
        return self.complete_at is not None and self.complete_at <= tokens

    def check(self) -> None:
        if self.failure is not None:
            raise GrammarError(f"constrained decoding failed: {self.failure}")
        if self.matcher.is_error():
            raise GrammarError(f"constrained decoding failed: {self.matcher.get_error()}")


class Grammars:
    """Compiles StructuredOutputs against one tokenizer, built on first use (a 150k vocabulary
    takes about a second), so a server or engine that never sees a grammar never pays for it."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int | None = None) -> None:
        self._load_tokenizer = load_tokenizer  # -> a transformers fast tokenizer
        self.vocab_size = vocab_size  # the model's logits width, when it differs from the tokenizer's

    @classmethod
    def of_checkpoint(cls, tokenizer_path: str, vocab_size: int, trust_remote_code: bool) -> "Grammars":
        """tokenizer_path: the folder or GGUF file the server's tokenizer comes from (EngineConfig.tokenizer_path),
        so that a grammar's tokens are the ones the prompts were encoded with."""

        def load():  # only an engine that meets a grammar needs transformers (a GGUF's tokenizer: converted once)
            from moe_serve.engine.gguf import load_tokenizer

            return load_tokenizer(tokenizer_path, trust_remote_code)

        return cls(load, vocab_size)

    @cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        try:
            return llguidance.hf.from_tokenizer(self._load_tokenizer(), n_vocab=self.vocab_size)
        except Exception as exc:  # no tokenizer files, a slow tokenizer, a vocabulary over the model's, ...
            raise GrammarError(f"structured outputs need the checkpoint's fast tokenizer: {exc}") from exc

    def check(self, structured: StructuredOutput) -> None:
        """GrammarError with llguidance's message unless the grammar compiles for this tokenizer."""
        error = llguidance.LLMatcher.validate_grammar(grammar_text(structured), self.tokenizer)
        if error:
            raise GrammarError(error.strip())

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        tokenizer = self.tokenizer
        matcher = llguidance.LLMatcher(tokenizer, grammar_text(structured), log_level=0)
        if matcher.is_error():  # the constructor reports a grammar that does not compile this way
            raise GrammarError(matcher.get_error().strip())
        return GrammarMatcher(matcher, tokenizer.vocab_size)


class MaskBuffer:
    """The host rows each step's masks are filled into, kept from step to step: a constrained step
    then allocates nothing. On CUDA they are pinned, and the device reads them in place
    (moe_serve/engine/token_mask.py): nothing is copied. (With a pinned buffer made and set to ones,
    then a new device tensor, every step, the H100 measured 49-91 us for a lone row's fill, whose
    llguidance part takes 5-7 us on a CPU host.)"""

    def __init__(self, capacity: int, width: int, device: torch.device) -> None:
        cuda = device.type == "cuda"
        self.capacity, self.width, self.device = capacity, width, device
        self.host = torch.empty((capacity, width), dtype=torch.int32, pin_memory=cuda)  # [C, W]
        # the device's last read of host: the rows are written again only once it is done (it is,
        # unless that step failed before reading its tokens back)
        self.read = torch.cuda.Event() if cuda else None
        self._slices: dict[int, torch.Tensor] = {}  # B -> host[:B]

    def fits(self, size: int, width: int, device: torch.device) -> bool:
        return size <= self.capacity and width == self.width and device == self.device

    def writable(self, size: int) -> torch.Tensor:
        """host's first `size` rows [B, W], once the device is done reading them."""
        self.wait_for_reads()
        return self.rows(size)

    def wait_for_reads(self) -> None:
        # queried first: the reads are done by the time a fill comes (a step reads its tokens back after
        # them), and a wait would let go of the GIL, which the worker then waits to take back
        if self.read is not None and not self.read.query():
            self.read.synchronize()

    def rows(self, size: int) -> torch.Tensor:
        """host's first `size` rows [B, W]."""
        # made once per batch size: each slice is one more op on the engine thread, every step
        rows = self._slices.get(size)
        if rows is None:
            rows = self._slices[size] = self.host[:size]
        return rows


@dataclass(frozen=True, eq=False)
class StepGrammars:
    """A step's sampling rows as the masks see them, made once per batch (a follow job shares its step's)."""

    grammars: list[GrammarMatcher | None]  # every row's, None where a row has none
    rows: list[tuple[int, GrammarMatcher]]  # the constrained rows: (row of the batch, its matcher)
    constrained: list[GrammarMatcher]  # their matchers, in the order of rows
    matchers: list[llguidance.LLMatcher]  # and llguidance's
    targets: list[tuple[llguidance.LLMatcher, int]]  # (llguidance's, its row): the executor's fill

    @classmethod
    def of(cls, grammars: Sequence[GrammarMatcher | None]) -> "StepGrammars":
        rows = [(i, g) for i, g in enumerate(grammars) if g is not None]
        constrained = [grammar for _, grammar in rows]
        matchers = [grammar.matcher for grammar in constrained]
        return cls(list(grammars), rows, constrained, matchers, [(m, i) for m, (i, _) in zip(matchers, rows)])

    @property
    def size(self) -> int:
        """The batch's rows, constrained or not."""
        return len(self.grammars)


class PendingMasks:
    """A step's masks, filled either when the sampler asks for them (the forward is queued by then,
    so on CUDA the host fills while the device runs it) or on the FillWorker: handed to it when the
    step is scheduled, or, as a follow job (MaskFiller.follow), as soon as the step before read its
    tokens back. A follow job first consumes those tokens: on the worker, or, inline, when the next
    step asks for its masks (or a sequence needs its grammar settled before)."""

    def __init__(self, executor: llguidance.LLExecutor, step: StepGrammars, buffer: MaskBuffer,
                 worker: FillWorker | None, tokens: list[int] | None = None) -> None:
        self.executor = executor
        self.step = step
        self.buffer = buffer
        self.tokens = tokens  # a follow job's: each row's last sampled token, consumed before the fill
        # The executor's calls hand their rows to its thread pool, whose threads sleep between steps: a
        # lone row's fill measured 18.6 us through it a millisecond after the last call against 6.1 us
        # in the matcher's own call (2-core CPU host, a probe's walks of the default model's grammar,
        # 1 ms of busy host work before each call; its consume 6.9 against 2.0). So a job on the
        # engine thread, with few rows, calls each matcher; one on the worker makes one call for all.
        self.on_worker = worker is not None
        self._error: BaseException | None = None
        self._unconsumed = tokens is not None
        self._advanced: _thread.LockType | None = None  # a follow job's on the worker
        if tokens is not None:
            for grammar in self.step.constrained:
                grammar.job = self
            if worker is not None:
                self._advanced = _thread.allocate_lock()  # released once the tokens are consumed
                self._advanced.acquire()
        self._filled = None if worker is None else worker.submit(self._fill)

    def result(self) -> TokenMask:
        """The filled masks. They hold until the next step's fill. A matcher broken by its last token,
        or by this fill, raises GrammarError: the step's chunks then retry alone, so only its
        sequence fails."""
        if self._filled is None:
            self._fill()
        else:
            self.wait()
        if self._error is not None:
            raise self._error
        for grammar in self.step.constrained:
            grammar.check()
        return TokenMask(self.buffer.rows(self.step.size), self.buffer.read)

    def wait(self) -> None:
        """Until the worker ran this job (at once for an inline one, which fills in result())."""
        _pass(self._filled)

    def wait_advanced(self) -> None:
        """Until a follow job's tokens are consumed: by the worker, or, inline, now (at once for a fill
        without tokens)."""
        self.advance_inline()
        _pass(self._advanced)

    def advance_inline(self) -> None:
        """An inline follow job's tokens consumed now, if they were not yet. One that fails is recorded
        in each matcher, whose next check() reports it."""
        if not self.on_worker:
            try:
                self._advance()
            except Exception:  # noqa: S110 - reported by the matchers' checks
                pass

    def _advance(self) -> None:
        """Consume a follow job's tokens, once."""
        if not self._unconsumed:
            return
        self._unconsumed = False
        try:
            self._consume()
        except BaseException as exc:  # tokens maybe not consumed: each sequence fails at its next mask
            for grammar in self.step.constrained:
                grammar.failure = exc
            raise
        finally:
            if self._advanced is not None:
                self._advanced.release()

    def _fill(self) -> None:
        try:
            self._advance()
            bits = self.buffer.writable(self.step.size)  # [B, W]
            if len(self.step.rows) < self.step.size:  # a row without a grammar allows every token
                bits.fill_(-1)
            row_bytes = self.buffer.width * 4
            if self.on_worker:
                self.executor.unsafe_compute_mask_ptr(self.step.targets, bits.data_ptr(), row_bytes, self.step.size)
            else:
                for matcher, i in self.step.targets:
                    matcher.unsafe_compute_mask_ptr(bits.data_ptr() + i * row_bytes, row_bytes)
        except BaseException as exc:  # raised on the engine thread, by result()
            self._error = exc

    def _consume(self) -> None:
        accepted = consume_tokens(self.executor, self.step.matchers, self.tokens, self.on_worker)
        stopped = map(llguidance.LLMatcher.is_stopped, self.step.matchers)  # in C: the worker holds the GIL here
        for grammar, ok, stop in zip(self.step.constrained, accepted, stopped):
            grammar.consumed_one(ok, stop)


def consume_tokens(executor: llguidance.LLExecutor, matchers: list[llguidance.LLMatcher], tokens: list[int],
                   on_worker: bool) -> list[bool]:
    """Each matcher's token, and whether it was accepted: on the worker in one executor call off the GIL,
    else matcher by matcher (PendingMasks says why)."""
    if on_worker:
        return executor.consume_token_par(list(zip(matchers, tokens)))
    return list(map(llguidance.LLMatcher.consume_token, matchers, tokens))


def _pass(done: _thread.LockType | None) -> None:
    """Wait for a lock held until its work is done: taken and given back, any number of waiters pass."""
    if done is not None:
        done.acquire()
        done.release()


class FillWorker:
    """A thread that fills masks while the engine thread schedules, launches the forward and builds
    the sampler's batch. llguidance's fill runs off the GIL; what the worker needs the GIL for (taking a
    job, handing it back) it gets within the switch interval, which the worker sets to SWITCH_INTERVAL:
    at Python's default 5 ms a thread waiting for the GIL beside a busy engine thread waits until that
    thread blocks, which it does only when it waits for this fill. Jobs run in order, one at a time."""

    SWITCH_INTERVAL = 50e-6

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        sys.setswitchinterval(self.SWITCH_INTERVAL)
        self.thread = threading.Thread(target=self._serve, name="grammar-masks", daemon=True)
        self.thread.start()

    def submit(self, fill: Callable[[], None]):
        """Queue fill; returns a held lock, released once it ran."""
        done = _thread.allocate_lock()
        done.acquire()
        self._jobs.put((fill, done))
        return done

    def close(self) -> None:
        """The thread ends once the jobs queued before this ran."""
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            fill, done = job
            fill()  # reports its own errors
            done.release()


class MaskFiller:
    """Fills each step's masks into one MaskBuffer kept for the engine's life (grown with its largest
    batch): llguidance computes the constrained rows off the GIL, on its executor's threads for a job on
    the worker, matcher by matcher for one on the engine thread. A step with fewer than
    ahead_from_rows constrained rows fills on the engine thread when the sampler asks, once the
    forward is queued; one with more hands its fill to the FillWorker as it is scheduled, and the
    sampler waits for it as late as it can (sampler.sample). Such a step's tokens go back to the
    worker at once (follow), which consumes them and fills the next step's masks before that step is
    even scheduled; a smaller step's are consumed with the next fill.

    Why the split. A worker's hand-offs (a wake-up there, the GIL, a wake-up back) cost the engine
    thread more than a fill of a row or two: a lone row of the default model's 8k vocabulary takes
    llguidance ~1-7 us, and in a timing probe of the engine's steps (H100, timers around each part,
    not kept; the two ways in alternating rounds) one constrained sequence measured 1.36x
    unconstrained through the worker against 1.25x inline. 32 rows take ~200-480 us, which the
    engine thread then no longer waits for in series: 1.30x against 1.48x at 32 sequences, 1.28x
    against 1.32x at 8. (An earlier worker, at Python's default switch interval, measured no better
    than inline: it could only take the GIL when the engine thread blocked waiting for it.)"""

    ahead_from_rows = 4  # a step with this many constrained rows fills on the FillWorker

    def __init__(self) -> None:
        self.buffer: MaskBuffer | None = None  # made by the first constrained step
        self._follow: PendingMasks | None = None  # the next step's masks if its rows are the last step's
        self._latest: PendingMasks | None = None  # the last job handed to the worker

    @cached_property
    def worker(self) -> FillWorker:  # started by the first step that fills ahead
        return FillWorker()

    def close(self) -> None:
        """Stop the worker, if a step started one (an engine's close)."""
        if "worker" in self.__dict__:
            self.worker.close()

    @cached_property
    def executor(self) -> llguidance.LLExecutor:  # a thread pool: started by the first constrained step
        return llguidance.LLExecutor()

    def pending(self, grammars: Sequence[GrammarMatcher | None], device: torch.device) -> PendingMasks | None:
        """The masks of a step's sampling rows, filled on the FillWorker from now or on this thread
        by result(); None (and no work) when no row is constrained. A fill only reads the matchers,
        so a step that fails before result() leaves them as they were. The TokenMask it gives holds
        until the next step's fill."""
        follow, self._follow = self._follow, None
        if follow is not None and follow.step.grammars == grammars:  # the same matchers in the same rows: its masks
            return follow
        step = StepGrammars.of(grammars)
        if follow is not None:  # not this step's masks: its tokens, if inline, are consumed before any
            follow.advance_inline()  # fill reads the matchers (the worker's go before its next job)
        if not step.rows:
            return None
        width = (step.constrained[0].vocab_size + 31) // 32  # every matcher of an engine shares its tokenizer
        buffer = self._buffer(step.size, width, device)
        worker = self._worker_for(step)
        if worker is None and self._latest is not None:  # an inline fill reads matchers and writes rows
            self._latest.wait()  # that the worker's last job may still be at
        masks = PendingMasks(self.executor, step, buffer, worker)
        if worker is not None:
            self._latest = masks
        return masks

    def follow(self, masks: PendingMasks, tokens: Sequence[int]) -> None:
        """A step's sampled tokens [B] are back: each constrained row's token is consumed, then the masks
        of a next step with the same rows filled, which pending() hands out if it has them (a batch
        changes when a sequence joins or leaves; else the fill is simply redone). From ahead_from_rows
        rows the worker does both at once, while the engine thread builds its outputs, schedules and
        launches the next forward; with fewer, the hand-offs cost more (H100: one sequence at
        1.23-1.37x unconstrained through the worker, 1.24-1.27x consuming on the engine thread), and
        the engine thread does both when the next step asks for its masks, its forward queued: the
        tokens are consumed while the device runs it, not after the step, while the device idles."""
        worker = self._worker_for(masks.step)
        self._follow = PendingMasks(self.executor, masks.step, masks.buffer, worker,
                                    [tokens[i] for i, _ in masks.step.rows])
        if worker is not None:
            self._latest = self._follow

    def _worker_for(self, step: StepGrammars) -> FillWorker | None:
        """The FillWorker for a step of ahead_from_rows constrained rows or more; None: the engine thread."""
        return self.worker if len(step.rows) >= self.ahead_from_rows else None

    def _buffer(self, size: int, width: int, device: torch.device) -> MaskBuffer:
        if self.buffer is None or not self.buffer.fits(size, width, device):
            if self.buffer is not None:  # its pinned rows go back to torch's allocator, which knows of no reader
                self.buffer.wait_for_reads()
            # a power of two: a batch that grows step by step reallocates a few times, not every step
            self.buffer = MaskBuffer(1 << (size - 1).bit_length(), width, device)
        return self.buffer
