"""One choice of a response: engine token ids -> text deltas, stop strings, logprobs, token count.

Tokens are fed one at a time, so the text (and where a stop string cuts it) does not depend
on how many tokens the engine returned per step: streamed and non-streamed output agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from moe_serve.engine.messages import RequestOutput, SamplingParams, TokenLogprob
from moe_serve.server.detokenizer import IncrementalDetokenizer
from moe_serve.server.harmony import HarmonyStream
from moe_serve.server.reasoning import ReasoningStream
from moe_serve.server.stop import StopMatcher
from moe_serve.server.tokenizer import Tokenizer
from moe_serve.server.tool_parsers.stream import ToolCallDelta, ToolCallStream


@dataclass(frozen=True)
class TextOptions:
    """How a request's tokens become its text: stop strings and vLLM's detokenising extras."""

    stops: tuple[str, ...] = ()
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the stop string or stop token ends the text instead of being cut


class EngineRequestError(Exception):
    """The engine reported finish_reason "error" for one request."""


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of prompt tokens 1.., when asked
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""  # with --reasoning-parser (or harmony's analysis channel): kept out of `text`


class ChoiceDecoder:
    def __init__(self, index: int, tokenizer: Tokenizer, text: TextOptions, params: SamplingParams,
                 tool_calls: ToolCallStream | None = None, reasoning: ReasoningStream | None = None,
                 harmony: HarmonyStream | None = None) -> None:
        """harmony: the answer is in gpt-oss's harmony format, read from its tokens into reasoning, content
        and calls (instead of the text's going through reasoning and tool_calls)."""
        self.index = index
        self.completion_tokens = 0
        self._token_offsets: list[int] = []  # with a reasoning parser: where each token's text starts in the text
        self._text_length = 0  # characters of text detokenized so far
        self.finish_reason: str | None = None  # the engine's (or "stop" for a stop string), never "tool_calls"
        skip_special_tokens = text.skip_special_tokens and not (tool_calls and tool_calls.keeps_special_tokens)
        self._detok = IncrementalDetokenizer(partial(tokenizer.decode, skip_special_tokens=skip_special_tokens),
                                             tokenizer.backend, skip_special_tokens)
        self._tool_calls = tool_calls
        self._reasoning = reasoning
        self._harmony = harmony
        self._stops = StopMatcher(text.stops, text.include_stop_str_in_output)
        # a stop token is not text, unless the stop is to be included (EOS then still goes if special)
        self._hidden_token_ids = frozenset(() if text.include_stop_str_in_output else params.stop_token_ids)
        self._min_tokens = params.min_tokens  # as vLLM: stop strings are looked for only after these

    def consume(self, out: RequestOutput) -> ChoiceDelta:
        """Turn one engine output into what the client sees; sets finish_reason when done."""
        delta = self._decode(out)
        if self._reasoning is not None:  # the reasoning comes first: a call inside it is no call
            delta.reasoning, delta.text = self._reasoning.feed(delta.text, delta.finish_reason is not None)
        if self._tool_calls is not None:  # tool markup out of the text and into calls
            delta.text, delta.tool_calls = self._tool_calls.feed(delta.text, delta.finish_reason is not None)
        if delta.finish_reason == "stop" and self._called():  # one cut by max_tokens keeps "length"
            delta.finish_reason = "tool_calls"
        return delta

    @property
    def reasoning_tokens(self) -> int:
        """Tokens of the answer that went to its reasoning: harmony's analysis text, token by token;
        with a reasoning parser, the tokens whose text starts inside the <think> section."""
        if self._harmony is not None:
            return self._harmony.reasoning_tokens
        if self._reasoning is None:
            return 0
        return sum(self._reasoning.in_reasoning(offset) for offset in self._token_offsets)

    def _called(self) -> bool:
        return any(reader is not None and reader.called for reader in (self._tool_calls, self._harmony))

    def _decode(self, out: RequestOutput) -> ChoiceDelta:
        if out.finish_reason == "error":
            raise EngineRequestError(out.error or "the engine failed this request")
        delta = ChoiceDelta(self.index, prompt_logprobs=list(out.prompt_logprobs))
        for i, token in enumerate(out.new_token_ids):
            self.completion_tokens += 1
            if token in self._hidden_token_ids:  # EOS: counted as a token, but it is not text
                continue
            if i < len(out.logprobs):
                delta.logprobs.append(out.logprobs[i])
            if self._feed(delta, self._text(token, delta)):
                return delta
        if out.finish_reason is not None and not self._feed(delta, self._text(None, delta)):
            delta.text += self._stops.flush()
            self.finish_reason = delta.finish_reason = out.finish_reason
        return delta

    def _text(self, token: int | None, delta: ChoiceDelta) -> str:
        """The text a token adds (None: what is left at the end). With harmony that is the content
        alone, and the token's reasoning and call pieces go into delta as they are, past the stop strings."""
        if self._harmony is None:
            if token is None:
                return self._detok.flush()
            if self._reasoning is not None:
                self._token_offsets.append(self._text_length)
            text = self._detok.add(token)
            self._text_length += len(text)
            return text
        if token is None:
            return ""
        part = self._harmony.add(token)
        delta.reasoning += part.reasoning
        for call in part.tool_calls:  # a call's pieces within one output as one delta
            if delta.tool_calls and delta.tool_calls[-1].index == call.index:
                delta.tool_calls[-1].arguments += call.arguments
            else:
                delta.tool_calls.append(call)
        return part.content

    def _feed(self, delta: ChoiceDelta, text: str) -> bool:
        """Append text through the stop matcher; True once a stop string ended the choice."""
        if self.completion_tokens <= self._min_tokens:
            delta.text += text
            return False
        safe, hit = self._stops.feed(text)
        delta.text += safe
        if hit:
            self.finish_reason = delta.finish_reason = "stop"
        return hit
