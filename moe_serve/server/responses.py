"""OpenAI response bodies, byte-for-byte in the shapes the API documents (chat and completions)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from moe_serve.engine.messages import TokenLogprob
from moe_serve.server.choice import ChoiceDelta
from moe_serve.server.tool_parsers.stream import ToolCallDelta

TokenText = Callable[[int], str]


def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int) -> dict:
    """OpenAI's CompletionUsage; reasoning_tokens: of the completion tokens, those of the reasoning."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens_details": {"reasoning_tokens": reasoning_tokens}}


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

    def response_fields(self, choices: list[ChoiceDelta]) -> dict:
        """Fields of a whole non-streamed response beside its choices and usage."""
        ...


def prompt_logprobs_body(entries: list[TokenLogprob], top: int, token_text: TokenText) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token (nothing precedes it), then per token
    {token id: {logprob, rank, decoded_token}} for the token itself and its `top` best alternatives."""
    def entry(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    return [None] + [{str(e.token_id): entry(e.token_id, e.logprob, e.rank),
                      **{str(t): entry(t, lp, r) for r, (t, lp) in enumerate(e.top[:top], 1) if t != e.token_id}}
                     for e in entries]


class ChatFormat:
    id_prefix = "chatcmpl-"
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def __init__(self, token_text: TokenText, logprobs: bool, prompt_logprobs: int | None = None) -> None:
        self._token_text, self._logprobs, self._prompt_logprobs = token_text, logprobs, prompt_logprobs

    def response_fields(self, choices: list[ChoiceDelta]) -> dict:
        """vLLM's prompt_logprobs: every choice has the same prompt, so the response carries it once."""
        if self._prompt_logprobs is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs_body(choices[0].prompt_logprobs, self._prompt_logprobs,
                                                        self._token_text)}

    def choice(self, delta: ChoiceDelta) -> dict:
        message = {"role": "assistant", "content": delta.text}
        if delta.tool_calls:  # OpenAI's shape: no text beside the calls is null content
            message = {"role": "assistant", "content": delta.text or None,
                       "tool_calls": [_tool_call(call) for call in delta.tool_calls]}
        if delta.reasoning:
            message["reasoning_content"] = delta.reasoning
        return {"index": delta.index, "message": message,
                "logprobs": self._render_logprobs(delta.logprobs), "finish_reason": delta.finish_reason}

    def chunk_choice(self, delta: ChoiceDelta, first: bool) -> dict:
        content = {"role": "assistant", "content": delta.text} if first else {"content": delta.text}
        body = content if delta.text or first else {}
        if delta.reasoning:
            body = {**body, "reasoning_content": delta.reasoning}
        if delta.tool_calls:
            body = {**body, "tool_calls": [_tool_call_delta(call) for call in delta.tool_calls]}
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


def _tool_call(call: ToolCallDelta) -> dict:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _tool_call_delta(call: ToolCallDelta) -> dict:
    """A call's first delta names it (index, id, type, name); the later ones carry argument pieces."""
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {"index": call.index, **_tool_call(call)}


@dataclass(frozen=True)
class PromptEcho:
    """What completions choices repeat of their prompts (echo): choice i repeats prompt i // n."""

    texts: list[str]  # per prompt: as the request gave it, or decoded from its token ids
    token_ids: list[list[int]]
    choices_per_prompt: int  # n

    def of_choice(self, index: int) -> tuple[str, list[int]]:
        prompt = index // self.choices_per_prompt
        return self.texts[prompt], self.token_ids[prompt]


class CompletionFormat:
    id_prefix = "cmpl-"
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def __init__(self, token_text: TokenText, logprobs: int | None, echo: PromptEcho | None = None,
                 prompt_logprobs: int | None = None) -> None:
        self._token_text, self._logprobs = token_text, logprobs
        self._echo, self._prompt_logprobs = echo, prompt_logprobs
        self._offsets: dict[int, int] = {}  # choice index -> text_offset of its next token

    def response_fields(self, choices: list[ChoiceDelta]) -> dict:
        return {}

    def choice(self, delta: ChoiceDelta) -> dict:
        body = self.chunk_choice(delta, True)
        if self._prompt_logprobs is not None:  # vLLM's extra, per choice
            body["prompt_logprobs"] = prompt_logprobs_body(delta.prompt_logprobs, self._prompt_logprobs,
                                                           self._token_text)
        return body

    def chunk_choice(self, delta: ChoiceDelta, first: bool) -> dict:
        """The first chunk of a choice (or the whole one) starts with its echoed prompt."""
        text, prompt_ids = self._echo.of_choice(delta.index) if self._echo and first else ("", [])
        return {"index": delta.index, "text": text + delta.text,
                "logprobs": self._render_logprobs(delta, prompt_ids), "finish_reason": delta.finish_reason}

    def _render_logprobs(self, delta: ChoiceDelta, prompt_ids: list[int]) -> dict | None:
        """OpenAI's legacy block; an echoed prompt's tokens come first, the first one without a logprob."""
        if self._logprobs is None:
            return None
        scored = (delta.prompt_logprobs if prompt_ids else []) + delta.logprobs
        tokens = [self._token_text(t) for t in prompt_ids[:1] + [e.token_id for e in scored]]
        offsets, at = [], self._offsets.get(delta.index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self._offsets[delta.index] = at
        first: list[None] = [None] if prompt_ids else []
        return {"tokens": tokens, "token_logprobs": first + [e.logprob for e in scored],
                "top_logprobs": first + [{self._token_text(t): lp for t, lp in e.top[:self._logprobs]}
                                         for e in scored],
                "text_offset": offsets}
