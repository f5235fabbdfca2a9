"""A validated request -> the engine requests it needs: token ids, length checks, sampling params."""
from __future__ import annotations

from dataclasses import dataclass

from engine.messages import EngineReady, GenerateRequest, SamplingParams
from server.errors import bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest, GenerationFields
from server.tokenizer import Tokenizer


@dataclass(frozen=True)
class Plan:
    """What one HTTP request asks of the engine; choice i is requests[i]."""

    requests: list[GenerateRequest]
    prompt_tokens: int  # for usage: each prompt counted once, however large n is


def chat_prompts(body: ChatCompletionRequest, tokenizer: Tokenizer) -> list[list[int]]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return [tokenizer.chat_prompt_ids(messages)]


def completion_prompts(body: CompletionRequest, tokenizer: Tokenizer, vocab_size: int) -> list[list[int]]:
    prompts = []
    for prompt in body.prompts():
        ids = tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "prompt")
        if not ids:
            raise bad_request("the prompt is empty", "prompt")
        prompts.append(ids)
    return prompts


def make_plan(body: GenerationFields, prompts: list[list[int]], request_id: str, engine: EngineReady,
              stop_token_ids: tuple[int, ...], max_tokens_cap: int | None, logprobs: int | None) -> Plan:
    n = body.n or 1
    requests = []
    for p, ids in enumerate(prompts):
        max_tokens = _max_tokens(body.requested_max_tokens(), len(ids), engine.max_model_len, max_tokens_cap)
        for i in range(n):
            params = _sampling_params(body, max_tokens, None if body.seed is None else body.seed + i,
                                      stop_token_ids, logprobs)
            requests.append(GenerateRequest(f"{request_id}-{p * n + i}", tuple(ids), params))
    return Plan(requests, sum(len(ids) for ids in prompts))


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int, cap: int | None) -> int:
    room = max_model_len - prompt_len
    if requested is None:
        if room < 1:
            raise bad_request(f"the prompt has {prompt_len} tokens; this model's context is {max_model_len} "
                              "tokens, which leaves no room to generate", None, "context_length_exceeded")
        return min(room, cap) if cap is not None else room
    if requested < 1:
        raise bad_request(f"max_tokens must be at least 1, got {requested}", "max_tokens")
    if cap is not None and requested > cap:
        raise bad_request(f"max_tokens is {requested}; this server allows at most {cap}", "max_tokens")
    if requested > room:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                          f"{prompt_len} tokens and max_tokens is {requested} ({prompt_len + requested} in all)",
                          "max_tokens", "context_length_exceeded")
    return requested


def _sampling_params(body: GenerationFields, max_tokens: int, seed: int | None,
                     stop_token_ids: tuple[int, ...], logprobs: int | None) -> SamplingParams:
    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens, temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0),
        top_k=given(body.top_k, 0), seed=seed, presence_penalty=given(body.presence_penalty, 0.0),
        frequency_penalty=given(body.frequency_penalty, 0.0), stop_token_ids=stop_token_ids, logprobs=logprobs,
    )
