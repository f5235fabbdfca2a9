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
The matchers themselves live in a process of their own (grammar_process.py, which says why): a
step's tokens are consumed there while the engine goes on, so the engine learns of a completion one
step later, and that step's token is dropped.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from copy import copy
from dataclasses import dataclass
from functools import cached_property

import llguidance
import torch

from moe_serve.engine.grammar_process import GrammarProcess, Job
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
    """One sequence's grammar, as the engine sees it: its llguidance matcher lives in the grammar
    process, and the steps' replies say here when that matcher completed or broke.

    The batched runner hands a step's tokens to MaskFiller.follow, whose job consumes them with the
    next step's fill. So the engine learns that a grammar completed one step late: Sequence.append
    then drops the token sampled after it (the mask allowed only EOS) and finishes the sequence as
    it would have at the completing token. A token the grammar refuses (only possible if the mask
    was bypassed) breaks the matcher, which the sequence's next mask reports."""

    def __init__(self, grammar: str, source: Grammars, vocab_size: int) -> None:
        self.grammar = grammar  # llguidance's grammar text, which the grammar process compiles
        self.source = source  # whose grammar process takes it
        self.mask_words = (vocab_size + 31) // 32  # int32 words of its mask row: a bit a tokenizer token
        self.process: GrammarProcess | None = None  # the one holding its matcher, from its first step
        self.gid = -1  # its matcher's id there
        self.complete_at: int | None = None  # tokens consumed when nothing but EOS could follow any more
        self.job: Job | None = None  # the follow job consuming its last token
        self.failure: str | None = None  # why its matcher broke, or its process ended

    def settle(self) -> None:
        """Wait until every token sent is consumed."""
        if self.job is not None:
            self.process.wait(self.job)
            self.job = None

    def complete_within(self, tokens: int) -> bool:
        """Whether the grammar was complete after the first `tokens` output tokens (those must be consumed)."""
        return self.complete_at is not None and self.complete_at <= tokens

    def check(self) -> None:
        if self.failure is not None:
            raise GrammarError(f"constrained decoding failed: {self.failure}")


class Grammars:
    """Compiles StructuredOutputs against one tokenizer, built on first use (a 150k vocabulary
    takes about a second), so a server or engine that never sees a grammar never pays for it."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int | None = None) -> None:
        self._load_tokenizer = load_tokenizer  # -> a transformers fast tokenizer
        self.vocab_size = vocab_size  # the model's logits width, when it differs from the tokenizer's
        self.grammar_process: GrammarProcess | None = None  # started by the first matcher (an engine's)

    @classmethod
    def of_checkpoint(cls, tokenizer_path: str, vocab_size: int, trust_remote_code: bool) -> "Grammars":
        """tokenizer_path: the folder or GGUF file the server's tokenizer comes from (EngineConfig.tokenizer_path),
        so that a grammar's tokens are the ones the prompts were encoded with."""

        def load():  # only an engine that meets a grammar needs transformers (a GGUF's tokenizer: converted once)
            from moe_serve.engine.gguf import load_tokenizer

            return load_tokenizer(tokenizer_path, trust_remote_code)

        return cls(load, vocab_size)

    @cached_property
    def tokenizer_spec(self) -> tuple[str, int | None, int | None]:
        """What llguidance builds its tokenizer from: the fast tokenizer's JSON (as llguidance.hf reads
        it: without padding or truncation), the vocabulary size and EOS; sent to the grammar process."""
        try:
            hf = self._load_tokenizer()
            backend = copy(hf.backend_tokenizer)
        except Exception as exc:  # no tokenizer files, a slow tokenizer, ...
            raise GrammarError(f"structured outputs need the checkpoint's fast tokenizer: {exc}") from exc
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str(), self.vocab_size, hf.eos_token_id

    @cached_property
    def tokenizer(self) -> llguidance.LLTokenizer:
        try:
            return llguidance.LLTokenizer(*self.tokenizer_spec)
        except ValueError as exc:  # a vocabulary over the model's, ...
            raise GrammarError(f"structured outputs need the checkpoint's fast tokenizer: {exc}") from exc

    def check(self, structured: StructuredOutput) -> None:
        """GrammarError with llguidance's message unless the grammar compiles for this tokenizer."""
        self._check_text(grammar_text(structured))

    def _check_text(self, text: str) -> None:
        error = llguidance.LLMatcher.validate_grammar(text, self.tokenizer)
        if error:
            raise GrammarError(error.strip())

    def matcher(self, structured: StructuredOutput) -> GrammarMatcher:
        """A new sequence's grammar, checked here (GrammarError) and compiled again by the grammar process.
        The first one starts that process before this one's tokenizer is built: the two build theirs at
        once (a 151,936-token vocabulary on a 2-core CPU host: 1.7-1.8 s from the first matcher to its
        first masks, against 2.9 s with the process started by the first step)."""
        text = grammar_text(structured)
        self.live_process()
        self._check_text(text)
        return GrammarMatcher(text, self, self.tokenizer.vocab_size)

    def live_process(self) -> GrammarProcess:
        """The grammar process new matchers go to: started now if none is, or the last one ended."""
        if self.grammar_process is None or self.grammar_process.ended is not None:
            self.grammar_process = GrammarProcess(self.tokenizer_spec)
        return self.grammar_process

    def close(self) -> None:
        """End the grammar process, if a matcher started one (an engine's close)."""
        if self.grammar_process is not None:
            self.grammar_process.close()


class MaskBuffer:
    """The host rows each step's masks are copied into from the grammar process's memory, kept from
    step to step: a constrained step then allocates nothing. On CUDA they are pinned, and the device
    reads them in place (moe_serve/engine/token_mask.py): nothing more is copied. (With a pinned
    buffer made and set to ones, then a new device tensor, every step, the H100 measured 49-91 us
    for a lone row's fill, whose llguidance part takes 5-7 us on a CPU host.)"""

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
        if self.read is not None:
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

    @classmethod
    def of(cls, grammars: Sequence[GrammarMatcher | None]) -> "StepGrammars":
        return cls(list(grammars), [(i, g) for i, g in enumerate(grammars) if g is not None])

    @property
    def size(self) -> int:
        """The batch's rows, constrained or not."""
        return len(self.grammars)


class PendingMasks:
    """A step's masks, on their way from the grammar process: sent when the step is scheduled or, as a
    follow job (MaskFiller.follow), as soon as the step before read its tokens back, which the
    process consumes first. The engine thread reads the reply when the sampler asks for the masks."""

    def __init__(self, process: GrammarProcess, step: StepGrammars, buffer: MaskBuffer,
                 tokens: list[int] | None = None) -> None:
        self.process, self.step, self.buffer = process, step, buffer
        self.tokens = tokens  # a follow job's: each constrained row's last sampled token, consumed before the fill
        self.job = process.submit(step, tokens)
        if tokens is not None:
            for _, grammar in step.rows:
                grammar.job = self.job

    def result(self) -> TokenMask:
        """The filled masks. They hold until the next step's. A matcher broken by its last token, or
        by this fill, raises GrammarError: the step's chunks then retry alone, so only its sequence
        fails."""
        self.process.wait(self.job)
        if self.process.failed:  # some matcher did: is it one of these?
            for _, grammar in self.step.rows:
                grammar.check()
        rows = self.buffer.writable(self.step.size)
        rows.copy_(self.job.rows[:self.step.size])
        return TokenMask(rows, self.buffer.read)


class MaskFiller:
    """Each step's masks, from the grammar process (Grammars.live_process) into one MaskBuffer kept
    for the engine's life (grown with its largest batch). A step's masks are asked for as it is
    scheduled; the sampler waits for them as late as it can (sampler.sample). Its tokens go back at
    once (follow), and the process consumes them and fills the next step's masks while the engine
    thread writes outputs, schedules and launches the next forward."""

    def __init__(self) -> None:
        self.buffer: MaskBuffer | None = None  # made by the first constrained step
        self._follow: PendingMasks | None = None  # the next step's masks if its rows are the last step's

    def pending(self, grammars: Sequence[GrammarMatcher | None], device: torch.device) -> PendingMasks | None:
        """The masks of a step's sampling rows, on their way; None (and no work) when no row is
        constrained. A fill only reads the matchers, so a step that fails before result() leaves
        them as they were. The TokenMask it gives holds until the next step's."""
        follow, self._follow = self._follow, None
        if follow is not None and follow.step.grammars == grammars:  # the same matchers in the same rows: its masks
            return follow
        step = StepGrammars.of(grammars)
        if not step.rows:
            return None
        grammar = step.rows[0][1]  # every matcher of an engine shares its tokenizer, and so its process
        return PendingMasks(grammar.source.live_process(), step, self._buffer(step.size, grammar.mask_words, device))

    def follow(self, masks: PendingMasks, tokens: Sequence[int]) -> None:
        """A step's sampled tokens [B] are back: each constrained row's token is consumed, then the masks
        of a next step with the same rows filled, which pending() hands out if it has them (a batch
        changes when a sequence joins or leaves; else the fill is simply redone)."""
        self._follow = PendingMasks(masks.process, masks.step, masks.buffer, [tokens[i] for i, _ in masks.step.rows])

    def _buffer(self, size: int, width: int, device: torch.device) -> MaskBuffer:
        if self.buffer is None or not self.buffer.fits(size, width, device):
            if self.buffer is not None:  # its pinned rows go back to torch's allocator, which knows of no reader
                self.buffer.wait_for_reads()
            # a power of two: a batch that grows step by step reallocates a few times, not every step
            self.buffer = MaskBuffer(1 << (size - 1).bit_length(), width, device)
        return self.buffer
