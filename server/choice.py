"""One choice of a response: engine token ids -> text deltas, stop strings, logprobs, token count.

Tokens are fed one at a time, so the text (and where a stop string cuts it) does not depend
on how many tokens the engine returned per step: streamed and non-streamed output agree.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import RequestOutput, TokenLogprob
from server.detokenizer import IncrementalDetokenizer
from server.stop import StopMatcher
from server.tokenizer import Tokenizer


class EngineRequestError(Exception):
    """The engine reported finish_reason "error" for one request."""


@dataclass
class ChoiceDelta:
    index: int
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceDecoder:
    def __init__(self, index: int, tokenizer: Tokenizer, stops: tuple[str, ...],
                 stop_token_ids: tuple[int, ...]) -> None:
        self.index = index
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self._detok = IncrementalDetokenizer(tokenizer.decode)
        self._stops = StopMatcher(stops)
        self._stop_token_ids = frozenset(stop_token_ids)

    def consume(self, out: RequestOutput) -> ChoiceDelta:
        """Turn one engine output into what the client sees; sets finish_reason when done."""
        if out.finish_reason == "error":
            raise EngineRequestError(out.error or "the engine failed this request")
        delta = ChoiceDelta(self.index)
        for i, token in enumerate(out.new_token_ids):
            self.completion_tokens += 1
            if token in self._stop_token_ids:  # EOS: counted as a token, but it is not text
                continue
            if i < len(out.logprobs):
                delta.logprobs.append(out.logprobs[i])
            if self._feed(delta, self._detok.add(token)):
                return delta
        if out.finish_reason is not None and not self._feed(delta, self._detok.flush()):
            delta.text += self._stops.flush()
            self.finish_reason = delta.finish_reason = out.finish_reason
        return delta

    def _feed(self, delta: ChoiceDelta, text: str) -> bool:
        """Append text through the stop matcher; True once a stop string ended the choice."""
        safe, hit = self._stops.feed(text)
        delta.text += safe
        if hit:
            self.finish_reason = delta.finish_reason = "stop"
        return hit
