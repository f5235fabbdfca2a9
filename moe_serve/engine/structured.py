"""Constrained decoding: a StructuredOutput compiled by llguidance, one matcher per sequence, one
bitmask per step for the constrained rows.

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
from collections.abc import Callable, Sequence
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

            return AutoTokenizer.from_pretrained(model_dir, trust_remote_code=trust_remote_code)

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


class MaskFiller:
    """Fills the constrained rows' masks of a step, all matchers in parallel (llguidance's threads,
    off the GIL), into one host buffer that travels to the device in one copy."""

    @cached_property
    def executor(self) -> llguidance.LLExecutor:  # a thread pool: started by the first constrained step
        return llguidance.LLExecutor()

    def token_mask(self, grammars: Sequence[GrammarMatcher | None], device: torch.device) -> TokenMask | None:
        """The mask of a step's sampling rows; None (and no work) when no row is constrained."""
        rows = [(i, g) for i, g in enumerate(grammars) if g is not None]
        if not rows:
            return None
        for _, grammar in rows:
            grammar.check()  # a broken matcher fails here, before the batch samples: only its row retries
        pinned = device.type == "cuda"  # torch's caching host allocator: no cudaHostAlloc per step
        width = (rows[0][1].vocab_size + 31) // 32  # every matcher of an engine shares its tokenizer
        bits = torch.empty((len(rows), width), dtype=torch.int32, pin_memory=pinned)  # [C, W]
        self.executor.unsafe_compute_mask_ptr([(g.matcher, k) for k, (_, g) in enumerate(rows)], bits.data_ptr(),
                                              bits.shape[1] * 4, len(rows))
        for _, grammar in rows:
            grammar.check()
        index = torch.tensor([i for i, _ in rows], dtype=torch.int64, pin_memory=pinned)  # [C]
        return TokenMask(index.to(device, non_blocking=True), bits.to(device, non_blocking=True))
