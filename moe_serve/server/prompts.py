"""A validated request -> the engine requests it needs: token ids, length checks, sampling params."""
from __future__ import annotations

import json
from dataclasses import dataclass

from moe_serve.engine.messages import EngineReady, GenerateRequest, SamplingParams, StructuredOutput
from moe_serve.server.errors import bad_request
from moe_serve.server.harmony import Harmony
from moe_serve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    GenerationFields,
    TokenizeChatRequest,
)
from moe_serve.server.settings import OPENAI_DEFAULTS, SamplingDefaults
from moe_serve.server.tokenizer import Tokenizer


@dataclass(frozen=True)
class Plan:
    """What one HTTP request asks of the engine; choice i is requests[i]."""

    requests: list[GenerateRequest]
    prompt_tokens: int  # for usage: each prompt counted once, however large n is


def chat_prompts(body: ChatCompletionRequest | TokenizeChatRequest, tokenizer: Tokenizer, tools: list[dict] | None = None,
                 harmony: Harmony | None = None) -> list[list[int]]:
    """tools: the tool objects the prompt offers (none when tool_choice is "none"); harmony: the server
    speaks gpt-oss's harmony format, which renders the prompt instead of the chat template."""
    if harmony is not None:
        return [harmony.prompt_ids(body, tools)]
    if body.reasoning_effort is not None:
        raise bad_request("reasoning_effort is the harmony format's (gpt-oss); this model's chat template takes "
                          "its switches in chat_template_kwargs", "reasoning_effort")
    messages = [_template_message(m) for m in body.messages]
    return [tokenizer.chat_prompt_ids(messages, **body.template_options(), tools=tools)]


def _template_message(message: ChatMessage) -> dict:
    """A message as chat templates take it: tool-call arguments as objects, as vLLM passes them
    (Qwen's and Llama's templates write them with tojson); arguments that are not JSON stay text. A turn
    that only reasoned (null content, no calls) has empty text: templates join content as a string."""
    content = message.text()
    rendered: dict = {"role": message.role, "content": "" if content is None and not message.tool_calls else content}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.reasoning_content is not None:
        rendered["reasoning_content"] = message.reasoning_content
    if message.tool_calls is not None:
        rendered["tool_calls"] = [
            {"id": call.id, "type": call.type,
             "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)}}
            for call in message.tool_calls]
    return rendered


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


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
              stop_token_ids: tuple[int, ...], max_tokens_cap: int | None, logprobs: int | None,
              structured: StructuredOutput | None = None, defaults: SamplingDefaults = OPENAI_DEFAULTS) -> Plan:
    """defaults: the sampling fields a request leaves unset (OpenAI's, or the checkpoint's generation config)."""
    n = body.n or 1
    stop_token_ids = _stop_token_ids(body, stop_token_ids, engine.vocab_size)
    _check_logit_bias(body, engine.vocab_size)
    requests = []
    for p, ids in enumerate(prompts):
        max_tokens = _max_tokens(body.requested_max_tokens(), len(ids), engine.max_model_len, max_tokens_cap,
                                 body.echoes_prompt())
        if (body.min_tokens or 0) > max_tokens:
            raise bad_request(f"min_tokens is {body.min_tokens}, above max_tokens ({max_tokens})", "min_tokens")
        for i in range(n):
            params = _sampling_params(body, max_tokens, None if body.seed is None else body.seed + i,
                                      stop_token_ids, logprobs, structured, defaults)
            requests.append(GenerateRequest(f"{request_id}-{p * n + i}", tuple(ids), params))
    return Plan(requests, sum(len(ids) for ids in prompts))


def _max_tokens(requested: int | None, prompt_len: int, max_model_len: int, cap: int | None, echo: bool) -> int:
    room = max_model_len - prompt_len
    if requested is None:
        if room < 1:
            raise bad_request(f"the prompt has {prompt_len} tokens; this model's context is {max_model_len} "
                              "tokens, which leaves no room to generate", None, "context_length_exceeded")
        return min(room, cap) if cap is not None else room
    if requested < (0 if echo else 1):
        raise bad_request(f"max_tokens must be at least 1 (0 with echo), got {requested}", "max_tokens")
    if cap is not None and requested > cap:
        raise bad_request(f"max_tokens is {requested}; this server allows at most {cap}", "max_tokens")
    if max(requested, 1) > room:  # the engine keeps a position free after the prompt even for 0
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                          f"{prompt_len} tokens and max_tokens is {requested} ({prompt_len + requested} in all)",
                          "max_tokens", "context_length_exceeded")
    return requested


def _sampling_params(body: GenerationFields, max_tokens: int, seed: int | None,
                     stop_token_ids: tuple[int, ...], logprobs: int | None,
                     structured: StructuredOutput | None, defaults: SamplingDefaults) -> SamplingParams:
    def given(value, default):
        return default if value is None else value

    return SamplingParams(
        max_tokens=max_tokens, temperature=given(body.temperature, defaults.temperature),
        top_p=given(body.top_p, defaults.top_p), top_k=given(body.top_k, defaults.top_k), seed=seed,
        presence_penalty=given(body.presence_penalty, 0.0),
        frequency_penalty=given(body.frequency_penalty, 0.0), stop_token_ids=stop_token_ids, logprobs=logprobs,
        prompt_logprobs=body.engine_prompt_logprobs(), structured=structured,
        logit_bias=tuple((int(token), bias) for token, bias in (body.logit_bias or {}).items()),
        min_p=given(body.min_p, defaults.min_p),
        repetition_penalty=given(body.repetition_penalty, defaults.repetition_penalty),
        min_tokens=given(body.min_tokens, 0),
    )


def _stop_token_ids(body: GenerationFields, eos_token_ids: tuple[int, ...], vocab_size: int) -> tuple[int, ...]:
    """The tokens that end a choice: the model's EOS set (unless ignore_eos) and the request's stop_token_ids."""
    requested = body.stop_token_ids or []
    bad = [t for t in requested if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})", "stop_token_ids")
    return tuple(sorted(set(requested) | (set() if body.ignore_eos else set(eos_token_ids))))


def _check_logit_bias(body: GenerationFields, vocab_size: int) -> None:
    for token in body.logit_bias or {}:
        if not (token.isascii() and token.isdigit() and int(token) < vocab_size):
            raise bad_request(f"logit_bias keys are token ids in [0, {vocab_size}), got '{token}'", "logit_bias")
