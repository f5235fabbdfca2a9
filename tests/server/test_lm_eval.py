"""lm-evaluation-harness against the real server on the default model (CPU), with local task files
(tests/server/lm_eval_tasks/). `local-completions`: a multiple-choice task (loglikelihood: echo + logprobs
1 + max_tokens 1, batched token-id prompts) and a perplexity task (loglikelihood_rolling, in several
windows), each loglikelihood equal to the model scored directly with transformers; and a generation task
(generate_until: greedy, a stop string, a few tokens, batched token-id prompts). `local-chat-completions`:
the same generation task through the chat template. Every generation lm-eval records equals what the
OpenAI SDK gets from the server for the same prompt, stop string and max_tokens at temperature 0, and
its exact_match is the one those answers give."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import openai
import pytest
import torch
import yaml

from tests.server.conftest import DEFAULT_MODEL, REPO, RunningServer

TASKS = REPO / "tests" / "server" / "lm_eval_tasks"
MAX_LENGTH = 128  # lm-eval's context window: the 438-token text is scored in four windows
BATCH_SIZE = 4  # prompts per request: lists of token-id lists
GENERATE = "moe_serve_generate"
COMPLETIONS_TASKS = ("moe_serve_multiple_choice", "moe_serve_rolling", GENERATE)

# The chat run goes through the Python API lm_eval's command line calls, with a TaskManager that does not
# index lm-eval's thousands of bundled tasks first (~20 s of a 2-core CPU); the same files come out.
CHAT_RUN = f"""
import sys
from lm_eval import simple_evaluate
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager

base_url, tasks, out = sys.argv[1:]
tracker = EvaluationTracker(output_path=out)
results = simple_evaluate(
    model="local-chat-completions", model_args=f"base_url={{base_url}},model=default,num_concurrent=1,max_retries=1",
    tasks=["{GENERATE}"], apply_chat_template=True, log_samples=True, evaluation_tracker=tracker,
    task_manager=TaskManager(include_path=tasks, include_defaults=False))
samples = results.pop("samples")
tracker.save_results_aggregated(results=results, samples=samples)
tracker.save_results_samples(task_name="{GENERATE}", samples=samples["{GENERATE}"])
"""


def lm_eval_env(out) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "cache")}


def lm_eval_output(out, tasks) -> tuple[dict, dict[str, list[dict]]]:
    """What a run wrote: its aggregated results per task, and its logged samples per task in doc order."""
    [results] = out.rglob("results_*.json")
    return json.loads(results.read_text())["results"], {
        task: sorted((json.loads(line) for path in out.rglob(f"samples_{task}_*.jsonl")
                      for line in path.read_text().splitlines()), key=lambda doc: doc["doc_id"])
        for task in tasks}


@pytest.fixture(scope="module")
def completions_run(default_model_server: RunningServer,
                    tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, list[dict]]]:
    """lm_eval's results and logged samples per task, from its own command line."""
    out = tmp_path_factory.mktemp("lm_eval")
    model_args = ",".join([f"base_url={default_model_server.base_url}/v1/completions", "model=default",
                           "tokenizer_backend=huggingface", f"tokenizer={DEFAULT_MODEL}",
                           f"max_length={MAX_LENGTH}", "num_concurrent=1", "max_retries=1"])
    subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                    "--tasks", ",".join(COMPLETIONS_TASKS), "--include_path", str(TASKS),
                    "--batch_size", str(BATCH_SIZE), "--output_path", str(out / "results"), "--log_samples"],
                   cwd=REPO, env=lm_eval_env(out), check=True, timeout=300, capture_output=True)
    return lm_eval_output(out / "results", COMPLETIONS_TASKS)


@pytest.fixture(scope="module")
def samples(completions_run) -> dict[str, list[dict]]:
    return completions_run[1]


@pytest.fixture(scope="module")
def chat_run(default_model_server: RunningServer,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict[str, list[dict]]]:
    """lm_eval's results and logged samples for the generation task through local-chat-completions."""
    out = tmp_path_factory.mktemp("lm_eval_chat")
    subprocess.run([sys.executable, "-c", CHAT_RUN, f"{default_model_server.base_url}/v1/chat/completions",
                    str(TASKS), str(out / "results")],
                   cwd=REPO, env=lm_eval_env(out), check=True, timeout=300, capture_output=True)
    return lm_eval_output(out / "results", (GENERATE,))


@pytest.fixture(scope="module")
def client(default_model_server: RunningServer) -> openai.OpenAI:
    """The reference: the OpenAI SDK straight at the server, no retries."""
    return openai.OpenAI(base_url=default_model_server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def reference():
    """The default model in fp32 through transformers, and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(DEFAULT_MODEL))


def scored(model, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of the continuation tokens' logprobs after the context, and whether each is the argmax."""
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([context + continuation])).logits[0], dim=-1)  # [T, V]
    rows = logp[len(context) - 1:-1]  # [C, V]: the positions before each continuation token
    targets = torch.tensor(continuation)
    return rows.gather(1, targets[:, None]).sum().item(), bool((rows.argmax(-1) == targets).all())


def test_multiple_choice_loglikelihoods_equal_transformers(samples, reference):
    model, tokenizer = reference
    docs = samples["moe_serve_multiple_choice"]
    assert len(docs) == len((TASKS / "multiple_choice.jsonl").read_text().splitlines())
    for doc in docs:
        for request, [(loglikelihood, is_greedy)] in zip(doc["arguments"].values(), doc["resps"]):
            # lm-eval splits a pair as causal models see it: the context's trailing spaces go to the
            # continuation, whose tokens are then the whole text's after the context's
            context = request["arg_0"].rstrip()
            continuation = request["arg_0"][len(context):] + request["arg_1"]
            context_ids = tokenizer.encode(context)
            want, greedy = scored(model, context_ids, tokenizer.encode(context + continuation)[len(context_ids):])
            assert float(loglikelihood) == pytest.approx(want, abs=2e-3), (context, continuation)
            assert is_greedy == str(greedy)


def test_rolling_loglikelihoods_equal_transformers(samples, reference):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    model, tokenizer = reference
    docs = samples["moe_serve_rolling"]
    assert len(docs) == len((TASKS / "rolling.jsonl").read_text().splitlines())
    for doc in docs:
        # local-completions keeps one position of max_length for the generated token, one for the context
        windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
            token_list=tokenizer.encode(doc["doc"]["text"]), prefix_token=tokenizer.eos_token_id,
            max_seq_len=MAX_LENGTH - 2, context_len=1)]
        want = sum(scored(model, context, continuation)[0] for context, continuation in windows)
        assert float(doc["resps"][0][0]) == pytest.approx(want, abs=5e-3), doc["doc"]["text"][:40]
    assert max(len(tokenizer.encode(d["doc"]["text"])) for d in docs) > 3 * MAX_LENGTH  # several windows


def generation_kwargs() -> dict:
    return yaml.safe_load((TASKS / f"{GENERATE}.yaml").read_text())["generation_kwargs"]


def cut_at_stop(text: str, stop: list[str]) -> str:
    return text[:min((text.index(s) for s in stop if s in text), default=len(text))]


def check_generations(results: dict, docs: list[dict], prompt_of, generate) -> float:
    """Each recorded generation equals the reference's, stopped where the stop strings say; exact_match
    per document and overall is the reference answers' against the targets. generate(context, stop) ->
    (text, finish_reason) is the reference, prompt_of(recorded arg_0) -> the context lm-eval sent."""
    kwargs = generation_kwargs()
    stop, max_tokens = kwargs["until"], kwargs["max_gen_toks"]
    assert kwargs["temperature"] == 0 and not kwargs["do_sample"]
    want_docs = [json.loads(line) for line in (TASKS / "generate.jsonl").read_text().splitlines()]
    assert [doc["doc"] for doc in docs] == want_docs
    matches, finish_reasons, stop_mattered = [], set(), False
    for doc in docs:
        context, answer = doc["doc"]["context"], doc["doc"]["answer"]
        request = doc["arguments"]["gen_args_0"]
        assert prompt_of(request["arg_0"]) == context
        assert request["arg_1"]["until"] == stop and request["arg_1"]["max_gen_toks"] == max_tokens
        [[recorded]] = doc["resps"]
        text, finish_reason = generate(context, stop, max_tokens)
        unstopped, _ = generate(context, None, max_tokens)
        assert recorded == text, context
        assert not any(s in recorded for s in stop), (context, recorded)  # the server cut at the stop string
        assert recorded == cut_at_stop(unstopped, stop), (context, unstopped)  # ... and there, not earlier
        stop_mattered |= unstopped != recorded
        finish_reasons.add(finish_reason)
        matches.append(float(text == answer))
        assert doc["exact_match"] == matches[-1], (context, recorded, answer)
    assert stop_mattered  # some greedy answer ran on past a stop string
    assert finish_reasons >= {"stop"}
    expected = sum(matches) / len(matches)
    assert results[GENERATE]["exact_match,none"] == pytest.approx(expected)
    return expected


def test_generate_until_completions_equal_the_sdk(completions_run, client):
    def generate(prompt, stop, max_tokens):
        [choice] = client.completions.create(model="default", prompt=prompt, stop=stop, max_tokens=max_tokens,
                                             temperature=0).choices
        return choice.text, choice.finish_reason

    results, samples = completions_run
    exact_match = check_generations(results, samples[GENERATE], lambda arg: arg, generate)
    # generate.jsonl's targets are some of the default model's greedy answers and some not, so the
    # metric says which
    assert 0 < exact_match < 1


def test_generate_until_chat_completions_equal_the_sdk(chat_run, client):
    def generate(content, stop, max_tokens):
        [choice] = client.chat.completions.create(model="default", messages=[{"role": "user", "content": content}],
                                                  stop=stop, max_tokens=max_tokens, temperature=0).choices
        return choice.message.content, choice.finish_reason

    def prompt_of(arg):  # --apply_chat_template: the messages, as JSON (in a one-element list)
        [[message]] = [json.loads(a) for a in arg]
        assert message["role"] == "user"
        return message["content"]

    results, samples = chat_run
    check_generations(results, samples[GENERATE], prompt_of, generate)
