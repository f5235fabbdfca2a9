"""Constrained decoding: a StructuredOutput compiled by llguidance, one matcher per sequence, one
bitmask per step for the batch, filled on the host while the forward runs.

llguidance (vLLM's `guidance` backend) compiles JSON schemas, regexes, choices and Lark grammars
against the tokenizer lazily, computes a row's mask in tens of microseconds and has no heavy
dependencies (xgrammar, the alternative, pulls in Triton). The server checks every grammar with
the same `Grammars.check` before submitting, so a bad one is a 400 and the engine only compiles
valid ones; a failure that still happens here fails its own sequence, never its batch.

A row's mask allows the tokens that keep the text a prefix of the language; once the text is a
complete sentence llguidance also allows the tokenizer's EOS, and once nothing can follow, only
EOS: the sequence then finishes at once ("stop"), without spending a step on the EOS.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import llguidance
import llguidance.hf
import torch

from moe_serve.engine.messages import StructuredOutput
from moe_serve.engine.sampler import TokenMask

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
    """One sequence's position in its grammar (MaskFiller reads its mask), advanced by each sampled token."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size  # the tokenizer's: the width of this matcher's mask

    def advance(self, token: int) -> bool:
        """Consume a sampled token; True once the grammar is complete (nothing but EOS may follow).

        A token the grammar refuses (only possible if the mask was bypassed) puts the matcher in
        its error state, which the sequence's next fill reports."""
        self.matcher.consume_token(token)
        return self.matcher.is_stopped() and not self.matcher.is_error()

    def check(self) -> None:
        if self.matcher.is_error():
            raise GrammarError(f"constrained decoding failed: {self.matcher.get_error()}")


class Grammars:
    """Compiles StructuredOutputs against one tokenizer, built on first use (a 150k vocabulary
    takes about a second), so a server or engine that never sees a grammar never pays for it."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int | None = None) -> None:
        self._load_tokenizer = load_tokenizer  # -> a transformers fast tokenizer
        self.vocab_size = vocab_size  # the model's logits width, when it differs from the tokenizer's

    @classmethod
    def of_checkpoint(cls, model_dir: str, vocab_size: int, trust_remote_code: bool) -> "Grammars":
        def load():
            from transformers import AutoTokenizer  # only an engine that meets a grammar needs it

            from moe_serve.engine.gguf import tokenizer_source

            folder, gguf = tokenizer_source(model_dir)  # a GGUF file's tokenizer is in its metadata
            return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code, **gguf)

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


@dataclass(frozen=True)
class PendingMasks:
    """A step's masks while llguidance fills them into host memory; result() waits for them."""

    fill: Future[None]
    bits: torch.Tensor  # [B, W] int32 on the host, pinned on CUDA
    grammars: list[GrammarMatcher]  # the constrained rows' matchers
    device: torch.device

    def result(self) -> TokenMask:
        """The masks on the device: the upload is queued, not waited for."""
        self.fill.result()
        for grammar in self.grammars:
            grammar.check()  # a matcher that broke while filling fails before the batch samples
        return TokenMask(self.bits.to(self.device, non_blocking=True))


class MaskFiller:
    """Fills a step's masks beside its forward: llguidance computes every constrained row at once on
    its own threads, off the GIL, called from one worker thread so that the engine thread goes on
    launching (on CUDA: then the device runs) the forward meanwhile. The masks of step N depend only
    on the tokens before it, so the fill starts before the forward does. (The hand-off costs the
    engine thread tens of microseconds; the fill it hides grows with the batch and the vocabulary.)"""

    @cached_property
    def executor(self) -> llguidance.LLExecutor:  # a thread pool: started by the first constrained step
        return llguidance.LLExecutor()

    @cached_property
    def worker(self) -> Executor:  # waits on the executor's threads, so the engine thread need not
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")

    @contextmanager
    def filling(self, grammars: Sequence[GrammarMatcher | None], device: torch.device) -> Iterator[PendingMasks | None]:
        """Fill the masks of a step's sampling rows during the block; None (and no work) when no row is
        constrained. The block leaves the matchers alone until result(); leaving it waits for the
        fill, so a failed step's retry never meets a matcher still filling."""
        rows = [(i, g) for i, g in enumerate(grammars) if g is not None]
        if not rows:
            yield None
            return
        for _, grammar in rows:
            grammar.check()  # a broken matcher fails here, before the forward: only its row retries
        width = (rows[0][1].vocab_size + 31) // 32  # every matcher of an engine shares its tokenizer
        # every bit set: a row without a grammar allows every token. Pinned (torch's caching host
        # allocator, no cudaHostAlloc per step) so that the upload need not wait for the host
        bits = torch.full((len(grammars), width), -1, dtype=torch.int32, pin_memory=device.type == "cuda")  # [B, W]
        fill = self.worker.submit(self.executor.unsafe_compute_mask_ptr, [(g.matcher, i) for i, g in rows],
                                  bits.data_ptr(), width * 4, len(grammars))
        try:
            yield PendingMasks(fill, bits, [g for _, g in rows], device)
        finally:
            wait([fill])
