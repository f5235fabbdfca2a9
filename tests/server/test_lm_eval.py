"""lm-evaluation-harness's `local-completions` model against the real server on the default model
(CPU): a multiple-choice task (loglikelihood: echo + logprobs 1 + max_tokens 1, batched token-id
prompts) and a perplexity task (loglikelihood_rolling, in several windows) from local files
(tests/server/lm_eval_tasks/), each loglikelihood equal to the model scored directly with transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.server.conftest import DEFAULT_MODEL, REPO, RunningServer

TASKS = REPO / "tests" / "server" / "lm_eval_tasks"
MAX_LENGTH = 128  # lm-eval's context window: the 438-token text is scored in four windows
BATCH_SIZE = 4  # prompts per request: lists of token-id lists


@pytest.fixture(scope="module")
def samples(default_model_server: RunningServer, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """lm_eval's logged samples per task, from its own command line."""
    out = tmp_path_factory.mktemp("lm_eval")
    model_args = ",".join([f"base_url={default_model_server.base_url}/v1/completions", "model=default",
                           "tokenizer_backend=huggingface", f"tokenizer={DEFAULT_MODEL}",
                           f"max_length={MAX_LENGTH}", "num_concurrent=1", "max_retries=1"])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(out / "cache")}
    subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                    "--tasks", "moe_serve_multiple_choice,moe_serve_rolling", "--include_path", str(TASKS),
                    "--batch_size", str(BATCH_SIZE), "--output_path", str(out / "results"), "--log_samples"],
                   cwd=REPO, env=env, check=True, timeout=300, capture_output=True)
    return {task: [json.loads(line) for path in (out / "results").rglob(f"samples_{task}_*.jsonl")
                   for line in path.read_text().splitlines()]
            for task in ("moe_serve_multiple_choice", "moe_serve_rolling")}


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
