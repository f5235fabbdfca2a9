"""Prompt logprobs through the OpenAI SDK against the real server on the default model (CPU, fp32):
/v1/completions `echo` (with logprobs, max_tokens 0, token-id prompts, streamed) and vLLM's
`prompt_logprobs` extra on both endpoints equal the model scored directly with transformers."""
from __future__ import annotations

import openai
import pytest
import torch

from moe_serve.server.tokenizer import Tokenizer
from tests.server.conftest import DEFAULT_MODEL, MAX_MODEL_LEN, RunningServer

PROMPT = "import os\n\ndef list_python_files(root):\n"


@pytest.fixture(scope="module")
def client(default_model_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=default_model_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(str(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def score():
    """ids -> transformers' log-softmax at every position [P, V] (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval()

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)

    return log_softmax


def complete(client: openai.OpenAI, server: RunningServer, **kwargs):
    return client.completions.create(model=server.model, temperature=0, **kwargs)


def test_echo_with_logprobs_repeats_the_prompt_and_scores_every_token(client, default_model_server, tokenizer, score):
    resp = complete(client, default_model_server, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3)
    [choice] = resp.choices
    ids = tokenizer.encode(PROMPT)
    want = score(ids)
    assert choice.text.startswith(PROMPT) and resp.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) + resp.usage.completion_tokens == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.tokens[:len(ids)] == [tokenizer.token_text(t) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([want[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                         abs=1e-3)
    assert all(len(top) == 2 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    plain = complete(client, default_model_server, prompt=PROMPT, logprobs=2, max_tokens=3)
    assert choice.text == PROMPT + plain.choices[0].text  # echo changes nothing generated
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)


def test_echo_of_token_id_prompts_with_max_tokens_zero_only_scores(client, default_model_server, tokenizer, score):
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode("Hello world")]
    resp = complete(client, default_model_server, prompt=prompts, echo=True, logprobs=1, max_tokens=0)
    assert resp.usage.completion_tokens == 0
    for choice, ids in zip(sorted(resp.choices, key=lambda c: c.index), prompts):
        want = score(ids)
        assert choice.text == tokenizer.decode(ids) and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) == len(ids)
        assert choice.logprobs.token_logprobs[1:] == pytest.approx(
            [want[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-3)
    flat = complete(client, default_model_server, prompt=prompts[1], echo=True, max_tokens=2)  # one list of ids
    assert flat.choices[0].text.startswith(tokenizer.decode(prompts[1])) and flat.choices[0].logprobs is None


def test_streamed_echo_starts_with_the_prompt(client, default_model_server):
    echoed = {"prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 4}
    whole = complete(client, default_model_server, **echoed)
    chunks = list(complete(client, default_model_server, stream=True, **echoed))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    streamed = [x for c in chunks for x in c.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:])


def check_vllm_prompt_logprobs(entries: list, ids: list[int], top: int, want: torch.Tensor,
                               tokenizer: Tokenizer) -> None:
    """vLLM's shape: None, then {token id: {logprob, rank, decoded_token}} with the token and its top."""
    assert entries[0] is None and len(entries) == len(ids)
    for i, entry in enumerate(entries[1:], 1):
        token = entry[str(ids[i])]
        assert token["logprob"] == pytest.approx(want[i - 1, ids[i]].item(), abs=1e-3)
        assert token["rank"] == int((want[i - 1] > want[i - 1, ids[i]] + 1e-4).sum()) + 1
        assert token["decoded_token"] == tokenizer.token_text(ids[i])
        best = want[i - 1].topk(top).indices.tolist()
        assert set(entry) == {str(t) for t in best} | {str(ids[i])}
        assert [entry[str(t)]["rank"] for t in best] == list(range(1, top + 1))


def test_vllm_prompt_logprobs_on_completions(client, default_model_server, tokenizer, score):
    resp = complete(client, default_model_server, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 3})
    ids = tokenizer.encode(PROMPT)
    [choice] = resp.choices
    assert not choice.text.startswith(PROMPT) and choice.logprobs is None
    check_vllm_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, 3, score(ids), tokenizer)


def test_vllm_prompt_logprobs_on_chat_once_per_response(client, default_model_server, tokenizer, score):
    messages = [{"role": "user", "content": "Write a function that lists files."}]
    resp = client.chat.completions.create(model=default_model_server.model, messages=messages, max_tokens=2, n=2,
                                          extra_body={"prompt_logprobs": 1})
    ids = tokenizer.chat_prompt_ids(messages)
    check_vllm_prompt_logprobs(resp.model_extra["prompt_logprobs"], ids, 1, score(ids), tokenizer)
    plain = client.chat.completions.create(model=default_model_server.model, messages=messages, max_tokens=2)
    assert "prompt_logprobs" not in (plain.model_extra or {})


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [5] * MAX_MODEL_LEN, "echo": True, "max_tokens": 0}, "max_tokens"),
])
def test_bad_values_are_400_naming_the_parameter(default_model_server: RunningServer, path: str, body: dict,
                                                 param: str) -> None:
    resp = default_model_server.post(path, json={"model": default_model_server.model, **body})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param
