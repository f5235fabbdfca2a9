"""OpenAI response bodies, byte-for-byte in the shapes the API documents (chat and completions)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.messages import TokenLogprob
from server.choice import ChoiceDelta

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ResponseFormat(Protocol):
    """What differs between /v1/chat/completions and /v1/completions; the flow is shared."""

    id_prefix: str
    object_name: str
    chunk_object_name: str

    def choice(self, delta: ChoiceDelta) -> dict:
        """A whole choice of a non-streamed response (delta carries all of its text)."""
        ...

    def chunk_choice(self, delta: ChoiceDelta, first: bool) -> dict:
        ...


class ChatFormat:
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, token_text: TokenText, logprobs: bool) -> None:
        self._token_text, self._logprobs = token_text, logprobs

    def choice(self, delta: ChoiceDelta) -> dict:
        return {"index": delta.index, "message": {"role": "assistant", "content": delta.text},
                "logprobs": self._render_logprobs(delta.logprobs), "finish_reason": delta.finish_reason}

    def chunk_choice(self, delta: ChoiceDelta, first: bool) -> dict:
        content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        body = content if delta.text or first else {}
        return {"index": delta.index, "delta": body, "logprobs": self._render_logprobs(delta.logprobs),
                "finish_reason": delta.finish_reason}

    def _render_logprobs(self, entries: list[TokenLogprob]) -> dict | None:
        if not self._logprobs:
            return None
        return {"content": [self._entry(e.token_id, e.logprob, e.top) for e in entries]}

    def _entry(self, token_id: int, logprob: float, top: tuple[tuple[int, float], ...] | None) -> dict:
        text = self._token_text(token_id)
        entry = {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
        if top is not None:  # alternatives carry no alternatives of their own
            entry["top_logprobs"] = [self._entry(t, lp, None) for t, lp in top]
        return entry


class CompletionFormat:
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, token_text: TokenText, logprobs: bool) -> None:
        self._token_text, self._logprobs = token_text, logprobs
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    def choice(self, delta: ChoiceDelta) -> dict:
        return {"index": delta.index, "text": delta.text, "logprobs": self._render_logprobs(delta),
                "finish_reason": delta.finish_reason}

    def chunk_choice(self, delta: ChoiceDelta, first: bool) -> dict:
        return self.choice(delta)

    def _render_logprobs(self, delta: ChoiceDelta) -> dict | None:
        if not self._logprobs:
            return None
        tokens = [self._token_text(e.token_id) for e in delta.logprobs]
        offsets, at = [], self._offsets.get(delta.index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self._offsets[delta.index] = at
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in delta.logprobs],
                "top_logprobs": [{self._token_text(t): lp for t, lp in e.top} for e in delta.logprobs],
                "text_offset": offsets}
