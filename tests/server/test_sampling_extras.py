"""vLLM's sampling extras and the fields that change nothing, through the OpenAI SDK (extra_body)
against the real server on the tiny checkpoint: logit_bias, min_tokens, ignore_eos, stop_token_ids,
repetition_penalty, min_p, skip_special_tokens, include_stop_str_in_output, continue_final_message,
add_generation_prompt, chat_template_kwargs, metadata / store / service_tier / user, system_fingerprint,
GET /v1/models/{id}, POST /tokenize and /detokenize."""
from __future__ import annotations

import httpx
import openai
import pytest

from moe_serve.server.tokenizer import Tokenizer
from tests.server.conftest import MAX_MODEL_LEN, RunningServer

HELLO = [{"role": "user", "content": "hello"}]


def token(tokenizer: Tokenizer, text: str) -> int:
    [token_id] = tokenizer.encode(text, add_special_tokens=False)
    return token_id


def chat(client: openai.OpenAI, server: RunningServer, messages: list[dict] = HELLO, **kwargs):
    return client.chat.completions.create(model=server.model, messages=messages, **kwargs)


def test_logit_bias_decides_the_tokens(client: openai.OpenAI, server: RunningServer, tokenizer: Tokenizer) -> None:
    resp = chat(client, server, max_tokens=6, seed=1, logit_bias={str(token(tokenizer, "x")): 100})
    assert resp.choices[0].message.content == "x" * 6


def test_min_tokens_holds_eos_back_and_ignore_eos_ignores_it(client: openai.OpenAI, server: RunningServer,
                                                             tokenizer: Tokenizer) -> None:
    eos = {str(tokenizer.eos_token_ids[0]): 100}
    early = chat(client, server, max_tokens=20, logit_bias=eos, extra_body={"min_tokens": 5})
    assert early.choices[0].finish_reason == "stop" and early.usage.completion_tokens == 6  # 5, then EOS
    ignored = chat(client, server, max_tokens=4, logit_bias=eos, extra_body={"ignore_eos": True})
    assert ignored.choices[0].finish_reason == "length" and ignored.choices[0].message.content == ""
    shown = chat(client, server, max_tokens=2, logit_bias=eos, extra_body={"ignore_eos": True,
                                                                          "skip_special_tokens": False})
    assert shown.choices[0].message.content == "<|im_end|>" * 2


def test_stop_token_ids_and_include_stop_str_in_output(client: openai.OpenAI, server: RunningServer,
                                                       tokenizer: Tokenizer) -> None:
    x = token(tokenizer, "x")
    bias = {"logit_bias": {str(x): 100}, "max_tokens": 8}
    by_token = chat(client, server, **bias, extra_body={"stop_token_ids": [x]})
    assert by_token.choices[0].finish_reason == "stop" and by_token.choices[0].message.content == ""
    kept = chat(client, server, **bias, extra_body={"stop_token_ids": [x], "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "x"
    by_string = chat(client, server, **bias, stop=["xx"], extra_body={"include_stop_str_in_output": True})
    assert by_string.choices[0].message.content == "xx" and by_string.choices[0].finish_reason == "stop"
    streamed = chat(client, server, **bias, stop=["xx"], stream=True, extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == "xx"
    cut = chat(client, server, **bias, stop=["xx"], extra_body={"min_tokens": 3})  # stops only looked for after 3
    assert cut.choices[0].message.content == "xxx"


def test_repetition_penalty_over_prompt_and_output(client: openai.OpenAI, server: RunningServer,
                                                   tokenizer: Tokenizer) -> None:
    x, y = token(tokenizer, "x"), token(tokenizer, "y")
    # greedy: x (~100) beats y (~50); then x's 100 / 4 loses to y; then both are seen and x's 25 wins again
    resp = chat(client, server, max_tokens=5, temperature=0, logit_bias={str(x): 100, str(y): 50},
                extra_body={"repetition_penalty": 4.0})
    assert resp.choices[0].message.content == "xyxxx"
    # a prompt that already holds x starts with y
    seen = chat(client, server, messages=[{"role": "user", "content": "x"}], max_tokens=2, temperature=0,
                logit_bias={str(x): 100, str(y): 50}, extra_body={"repetition_penalty": 4.0})
    assert seen.choices[0].message.content == "yx"


def test_min_p_and_fields_that_change_nothing(client: openai.OpenAI, server: RunningServer) -> None:
    plain = chat(client, server, max_tokens=10, seed=3)
    same = chat(client, server, max_tokens=10, seed=3, metadata={"team": "a"}, store=False, service_tier="auto",
                user="u-1")
    assert same.choices[0].message.content == plain.choices[0].message.content
    assert plain.system_fingerprint and plain.system_fingerprint == same.system_fingerprint
    kept = chat(client, server, max_tokens=10, seed=3, extra_body={"min_p": 1.0})  # only the best token survives
    greedy = chat(client, server, max_tokens=10, temperature=0)
    assert kept.choices[0].message.content == greedy.choices[0].message.content
    completion = client.completions.create(model=server.model, prompt="def", max_tokens=3, stream=True)
    assert {chunk.system_fingerprint for chunk in completion} == {plain.system_fingerprint}


def test_continue_final_message_and_add_generation_prompt(client: openai.OpenAI, server: RunningServer,
                                                          tokenizer: Tokenizer) -> None:
    messages = [*HELLO, {"role": "assistant", "content": "Hello wor"}]
    resp = chat(client, server, messages=messages, max_tokens=2,
                extra_body={"continue_final_message": True, "add_generation_prompt": False})
    # the prompt ends inside the assistant's message: no <|im_end|>, no new turn
    want = tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nHello wor",
                            add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(want)
    bare = chat(client, server, max_tokens=1, extra_body={"add_generation_prompt": False})
    assert bare.usage.prompt_tokens == len(tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n",
                                                            add_special_tokens=False))


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"stop_token_ids": [100000]}, "stop_token_ids"), ({"min_tokens": 9}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({"service_tier": "gold"}, "service_tier"),
])
def test_bad_extras_are_400s_naming_them(client: openai.OpenAI, server: RunningServer, extra: dict,
                                         param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, server, max_tokens=8, extra_body=extra)
    assert info.value.body["param"] == param


def test_models_retrieve(client: openai.OpenAI, server: RunningServer) -> None:
    card = client.models.retrieve(server.model)
    assert card.id == server.model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("no-such-model")
    assert "no-such-model" in info.value.message and info.value.body["code"] == "model_not_found"


def test_tokenize_detokenize_round_trip(client: openai.OpenAI, server: RunningServer, tokenizer: Tokenizer) -> None:
    text = "def f(x): return 日本 🙂"
    tokens = httpx.post(server.base_url + "/tokenize", json={"model": server.model, "prompt": text,
                                                            "return_token_strs": True}, timeout=30).json()
    assert tokens["tokens"] == tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == MAX_MODEL_LEN and len(tokens["token_strs"]) == tokens["count"]
    back = httpx.post(server.base_url + "/detokenize", json={"model": server.model, "tokens": tokens["tokens"]},
                      timeout=30).json()
    assert back == {"prompt": tokenizer.decode(tokens["tokens"], skip_special_tokens=False)}
    assert tokenizer.decode(tokens["tokens"]) == text
    chat_count = httpx.post(server.base_url + "/tokenize", json={"messages": HELLO}, timeout=30).json()["count"]
    assert chat_count == chat(client, server, max_tokens=1).usage.prompt_tokens
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with_tools = httpx.post(server.base_url + "/tokenize", json={"messages": HELLO, "tools": tools}, timeout=30)
    assert with_tools.json()["count"] == chat(client, server, max_tokens=1, tools=tools,
                                              tool_choice="required").usage.prompt_tokens


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "a", "extra": 1}, "extra"),
    ("/detokenize", {"tokens": [100000]}, "tokens"), ("/tokenize", {"messages": []}, "messages"),
])
def test_bad_tokenize_bodies_are_400s(server: RunningServer, path: str, body: dict, param: str) -> None:
    resp = httpx.post(server.base_url + path, json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_chat_template_kwargs_reach_the_template(server: RunningServer) -> None:
    template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking %}<think>{% endif %}{{ reasoning_effort or '' }}")
    tokenizer = Tokenizer(str(server.model_dir), chat_template=template)

    def text(**kwargs) -> str:
        return tokenizer.decode(tokenizer.chat_prompt_ids(HELLO, template_kwargs=kwargs), skip_special_tokens=False)
    assert text() == "hello"
    assert text(enable_thinking=True, reasoning_effort="low") == "hello<think>low"
