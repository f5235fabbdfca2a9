"""Constrained decoding in the engine: every constrained answer parses and validates against its
schema (or matches its regex / choice) at temperature 0 and 1, batched beside unconstrained rows
that stay equal to their solo answers; a bad grammar or a broken matcher fails only its own
request; a constrained sequence never speculates, so --spec changes none of its tokens. Each row
of a step's masks is what its matcher computes alone, and a step without a grammar never fills."""
from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore, run_to_completion
from moe_serve.engine.messages import GenerateRequest, SamplingParams, StructuredOutput
from moe_serve.engine.token_mask import TokenMask
from moe_serve.engine.structured import GrammarError, Grammars, MaskFiller, grammar_text
from tests.engine.test_batching import run_together, tokens
from tests.server.tiny_tokenizer import build_tiny_tokenizer
from tests.tiny_checkpoints import build_tiny_checkpoint

EOS = 2  # the tiny tokenizer's <|im_end|>
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b"]}}}}
REGEX = r"[a-c]{2,5}-[0-9]{2}"
CHOICES = ["yes", "no", "maybe"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("structured") / "tiny-moe"
    build_tiny_checkpoint("mixtral", path)
    build_tiny_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def core(tiny_model: Path):
    engine = EngineCore(EngineConfig(model=str(tiny_model)))
    yield engine
    engine.close()


def constrained(request_id: str, structured: StructuredOutput, temperature: float, seed: int = 0,
                max_tokens: int = 80) -> GenerateRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, stop_token_ids=(EOS,),
                            structured=structured)
    return GenerateRequest(request_id, (1, 40, 41, 42, 2), params)


def text(tiny_model: Path, token_ids: list[int]) -> str:
    return AutoTokenizer.from_pretrained(tiny_model).decode(token_ids, skip_special_tokens=True)


def check_valid(structured: StructuredOutput, answer: str) -> None:
    if structured.kind == "json_schema":
        jsonschema.validate(json.loads(answer), json.loads(structured.spec))
    elif structured.kind == "json_object":
        assert isinstance(json.loads(answer), dict)
    elif structured.kind == "regex":
        assert re.fullmatch(structured.spec, answer), answer
    elif structured.kind == "grammar":
        assert structured.spec == GRAMMAR and re.fullmatch(GRAMMAR_AS_REGEX, answer), answer
    else:
        assert answer in json.loads(structured.spec)


GRAMMAR, GRAMMAR_AS_REGEX = 'start: "x" ("y" | "z")+ "!"', r"x[yz]+!"
STRUCTURED = [StructuredOutput("json_schema", json.dumps(SCHEMA)), StructuredOutput("regex", REGEX),
              StructuredOutput("choice", json.dumps(CHOICES)), StructuredOutput("grammar", GRAMMAR)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_rows_validate_and_unconstrained_rows_equal_solo(core: EngineCore, tiny_model: Path,
                                                                     temperature: float) -> None:
    free = [GenerateRequest(f"free{i}", (1, 50 + i, 60, 70), SamplingParams(max_tokens=10, temperature=t, seed=i))
            for i, t in enumerate((0.0, 1.0, 0.7))]
    bound = [constrained(f"c{i}", s, temperature, seed=i) for i, s in enumerate(STRUCTURED)]
    reqs = [free[0], *bound[:2], free[1], *bound[2:], free[2]]
    together = run_together(core, reqs)
    for request in reqs:
        outs = together[request.request_id]
        assert not any(o.error for o in outs), outs[-1].error
        assert tokens(outs) == run_to_completion(core, request).token_ids, request.request_id  # batched == solo
        structured = request.params.structured
        if structured is not None:
            assert outs[-1].finish_reason == "stop"
            check_valid(structured, text(tiny_model, tokens(outs)))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_any_json_object(core: EngineCore, tiny_model: Path, temperature: float) -> None:
    structured = StructuredOutput("json_object", "")  # keys and values of any length: room to close
    done = run_to_completion(core, constrained("obj", structured, temperature, max_tokens=200))
    assert done.finish_reason == "stop"
    check_valid(structured, text(tiny_model, done.token_ids))


@pytest.mark.parametrize("ahead_from_rows", [1, 10**9], ids=["fill-worker", "inline"])
def test_bad_grammar_and_broken_matcher_fail_only_their_request(core: EngineCore, tiny_model: Path,
                                                                ahead_from_rows: int,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core.runtime.batch_runner.masks, "ahead_from_rows", ahead_from_rows)
    rejected = core.add_request(constrained("bad", StructuredOutput("regex", "a(b"), 0.0))
    assert rejected is not None and rejected.finish_reason == "error" and "regex" in rejected.error
    good = constrained("good", StructuredOutput("regex", REGEX), 1.0, seed=5)
    broken = constrained("broken", StructuredOutput("choice", json.dumps(CHOICES)), 0.0)
    free = GenerateRequest("free", (1, 9, 8), SamplingParams(max_tokens=6, temperature=0))
    for request in (good, broken, free):
        assert core.add_request(request) is None
    [hash_sign] = AutoTokenizer.from_pretrained(tiny_model).encode("#", add_special_tokens=False)
    core.scheduler.find("broken").grammar.matcher.consume_token(hash_sign)  # no choice starts with it
    outputs: dict[str, list] = {"good": [], "broken": [], "free": []}
    while core.has_unfinished():
        for out in core.step():
            outputs[out.request_id].append(out)
    assert outputs["broken"][-1].finish_reason == "error" and "constrained decoding" in outputs["broken"][-1].error
    for request in (good, free):
        assert not outputs[request.request_id][-1].error
        assert tokens(outputs[request.request_id]) == run_to_completion(core, request).token_ids


def test_constrained_sequence_does_not_speculate(tiny_model: Path, core: EngineCore) -> None:
    request = constrained("spec", StructuredOutput("json_schema", json.dumps(SCHEMA)), 0.0)
    spec = EngineCore(EngineConfig(model=str(tiny_model), spec="self", spec_tokens=4))
    try:
        assert run_to_completion(spec, request).token_ids == run_to_completion(core, request).token_ids
        assert spec.runtime.spec_stats.drafts == 0
    finally:
        spec.close()


def test_grammars_read_the_tokenizer_folder_given(core: EngineCore, tmp_path: Path) -> None:
    """--tokenizer DIR beside a checkpoint without tokenizer files (as a GGUF whose tokenizer transformers
    cannot build): grammars compile against DIR's tokenizer, and answer as the checkpoint holding its own."""
    build_tiny_checkpoint("mixtral", tmp_path / "weights")  # the module's tiny_model, less its tokenizer
    build_tiny_tokenizer(tmp_path / "tokenizer")
    split = EngineCore(EngineConfig(model=str(tmp_path / "weights"), tokenizer=str(tmp_path / "tokenizer")))
    try:
        for i, structured in enumerate(STRUCTURED):
            request = constrained(f"split{i}", structured, 1.0, seed=i)
            done = run_to_completion(split, request)
            assert (done.token_ids, done.finish_reason) == (run_to_completion(core, request).token_ids, "stop")
    finally:
        split.close()


def test_grammars_name_what_does_not_compile(tiny_model: Path) -> None:
    grammars = Grammars(lambda: AutoTokenizer.from_pretrained(tiny_model))
    grammars.check(StructuredOutput("json_schema", json.dumps(SCHEMA)))
    for structured, words in [(StructuredOutput("json_schema", '{"type": "objekt"}'), "objekt"),
                              (StructuredOutput("json_schema", "{not json"), "line 1 column 2"),
                              (StructuredOutput("regex", "[a-"), "regex"),
                              (StructuredOutput("grammar", "start: missing_rule"), "missing_rule"),
                              (StructuredOutput("choice", "[]"), "choice")]:
        with pytest.raises(GrammarError, match=words):
            grammars.check(structured)
    with pytest.raises(GrammarError):
        grammar_text(StructuredOutput("choice", '["a", 1]'))


def refuse(*args, **kwargs):
    raise AssertionError("a step without a grammar ran the mask path")


class RefusingExecutor:
    unsafe_compute_mask_ptr = refuse


def test_a_step_without_a_grammar_skips_the_mask_path(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(core.runtime.batch_runner.masks, "executor", RefusingExecutor())
    monkeypatch.setattr(TokenMask, "restrict", refuse)
    reqs = [GenerateRequest(f"free{i}", (1, 9 + i, 8), SamplingParams(max_tokens=6, temperature=t, seed=i))
            for i, t in enumerate((0.0, 1.0, 0.0, 0.7))]
    for outs in run_together(core, reqs).values():
        assert outs[-1].finish_reason == "length" and not any(o.error for o in outs)


@pytest.mark.parametrize("ahead_from_rows", [1, 10**9], ids=["fill-worker", "inline"])
def test_each_filled_row_is_its_matchers_own_mask(tiny_model: Path, ahead_from_rows: int) -> None:
    grammars = Grammars(lambda: AutoTokenizer.from_pretrained(tiny_model))
    matchers = [grammars.matcher(s) for s in STRUCTURED]
    [brace] = AutoTokenizer.from_pretrained(tiny_model).encode("{", add_special_tokens=False)
    matchers[0].matcher.consume_token(brace)
    rows = [matchers[0], None, *matchers[1:], None]
    filler = MaskFiller()
    filler.ahead_from_rows = ahead_from_rows
    assert_own_rows(filler.pending(rows, torch.device("cpu")), rows)


class FailingExecutor:
    def unsafe_compute_mask_ptr(self, *args) -> None:
        raise RuntimeError("fill failed")


def test_a_fill_that_fails_on_the_worker_raises_where_its_masks_are_asked_for(tiny_model: Path) -> None:
    grammars = Grammars(lambda: AutoTokenizer.from_pretrained(tiny_model))
    filler = MaskFiller()
    filler.ahead_from_rows = 1
    filler.executor = FailingExecutor()
    masks = filler.pending([grammars.matcher(STRUCTURED[0])], torch.device("cpu"))
    with pytest.raises(RuntimeError, match="fill failed"):
        masks.result()
    del filler.executor  # the worker goes on: the next step's fill is its own
    rows = [grammars.matcher(STRUCTURED[1])]
    assert_own_rows(filler.pending(rows, torch.device("cpu")), rows)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_the_kept_buffer_leaves_no_row_of_an_earlier_step(tiny_model: Path, device: str) -> None:
    grammars = Grammars(lambda: AutoTokenizer.from_pretrained(tiny_model))
    matchers = [grammars.matcher(s) for s in STRUCTURED * 2]
    filler = MaskFiller()
    # every row constrained (no row set to ones first); then rows whose grammar left; then a larger batch
    for rows in (matchers[:3], [None, matchers[3], None], [*matchers[:4], None, *matchers[4:]]):
        assert_own_rows(filler.pending(rows, torch.device(device)), rows)


@pytest.mark.parametrize("ahead_from_rows", [1, 10**9], ids=["fill-worker", "inline"])
def test_a_follow_job_consumes_the_tokens_and_fills_the_next_steps_masks(tiny_model: Path,
                                                                         ahead_from_rows: int) -> None:
    grammars = Grammars(lambda: AutoTokenizer.from_pretrained(tiny_model))
    matchers = [grammars.matcher(s) for s in STRUCTURED]
    rows, cpu = [matchers[0], None, *matchers[1:]], torch.device("cpu")
    filler = MaskFiller()
    filler.ahead_from_rows = ahead_from_rows
    inline = ahead_from_rows > len(matchers)
    masks = filler.pending(rows, cpu)
    assert masks is not None
    bits = masks.result().bits
    # the last allowed token of each row (the unconstrained row's: any)
    tokens = [int(torch.signbit(row.unsqueeze(-1) << torch.arange(31, -1, -1, dtype=torch.int32)).flatten()
                  .nonzero().max()) for row in bits]
    filler.follow(masks, tokens)
    following = filler.pending(rows, cpu)  # the same rows: the follow job's fill, after it consumed the tokens
    assert following is not None and following.tokens == [tokens[i] for i, _ in masks.step.rows]
    if inline:  # consumed by the fill the next step asks for (its forward queued), not before
        assert [g.consumed for g in matchers] == [0] * len(matchers)
    assert_own_rows(following, rows)
    assert [g.consumed for g in matchers] == [1] * len(matchers)
    filler.follow(following, [5] * len(rows))  # refused by some grammars: their next fill reports it
    reordered = [rows[2], rows[0], None, rows[3]]  # a changed batch: filled again, after the tokens are consumed
    with pytest.raises(GrammarError, match="constrained decoding failed"):
        filler.pending(reordered, cpu).result()
    assert [g.consumed for g in matchers] == [2] * len(matchers)


def test_an_inline_follow_job_is_consumed_by_a_settle_or_a_step_without_its_rows(tiny_model: Path) -> None:
    """A sequence that ends by length settles its grammar at once; a step that leaves a sequence out (or has
    no constrained row) still consumes its token before any fill reads a matcher."""
    grammars = Grammars(lambda: AutoTokenizer.from_pretrained(tiny_model))
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    cpu = torch.device("cpu")
    for ending in ("settle", "other rows", "no rows"):
        matchers = [grammars.matcher(StructuredOutput("regex", "ab+")) for _ in range(2)]
        filler = MaskFiller()
        masks = filler.pending(matchers, cpu)
        masks.result()
        [a] = tokenizer.encode("a", add_special_tokens=False)
        filler.follow(masks, [a, a])
        assert [g.consumed for g in matchers] == [0, 0]
        if ending == "settle":
            matchers[0].settle()
        elif ending == "other rows":
            assert_own_rows(filler.pending([matchers[1]], cpu), [matchers[1]])
        else:
            assert filler.pending([None, None], cpu) is None
        assert [g.consumed for g in matchers] == [1, 1], ending
        assert not matchers[1].matcher.is_error() and matchers[1].matcher.compute_bitmask() != \
            grammars.matcher(StructuredOutput("regex", "ab+")).matcher.compute_bitmask()


class FailingConsume:
    def consume_token_par(self, *args) -> None:
        raise RuntimeError("consume failed")


def test_an_engines_close_ends_its_grammar_worker(tiny_model: Path) -> None:
    engine = EngineCore(EngineConfig(model=str(tiny_model)))
    engine.close()  # no constrained step: no worker was started
    engine = EngineCore(EngineConfig(model=str(tiny_model)))
    reqs = [constrained(f"w{i}", STRUCTURED[i % 2], 1.0, seed=i) for i in range(4)]
    assert all(outs[-1].finish_reason == "stop" for outs in run_together(engine, reqs).values())
    masks = engine.runtime.batch_runner.masks
    assert "worker" in masks.__dict__  # started by the steps of 4 constrained rows
    thread = masks.worker.thread
    engine.close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_a_consume_that_fails_on_the_worker_fails_each_of_its_sequences(tiny_model: Path) -> None:
    grammars = Grammars(lambda: AutoTokenizer.from_pretrained(tiny_model))
    matchers = [grammars.matcher(s) for s in STRUCTURED]
    filler = MaskFiller()
    masks = filler.pending(matchers, torch.device("cpu"))
    masks.result()
    filler.executor = FailingConsume()
    filler.follow(masks, [5] * len(matchers))
    with pytest.raises(RuntimeError, match="consume failed"):  # the follow job's masks: the step retries alone
        filler.pending(matchers, torch.device("cpu")).result()
    del filler.executor  # llguidance's again
    for matcher in matchers:  # where each sequence fails, its tokens maybe not consumed
        with pytest.raises(GrammarError, match="consume failed"):
            filler.pending([matcher], torch.device("cpu")).result()


@pytest.mark.parametrize("ahead_from_rows", [1, 10**9], ids=["fill-worker", "inline"])
def test_a_grammar_completed_by_the_last_allowed_token_ends_as_stop(core: EngineCore, ahead_from_rows: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the worker, the engine learns of the completion a step late (and drops that step's token)."""
    monkeypatch.setattr(core.runtime.batch_runner.masks, "ahead_from_rows", ahead_from_rows)
    choice = StructuredOutput("choice", json.dumps(CHOICES))
    whole = run_to_completion(core, constrained("whole", choice, 0.0))
    # no stop token: the grammar alone ends it, one step after it completes, without that step's token
    params = SamplingParams(max_tokens=80, temperature=0.0, structured=choice)
    alone = run_to_completion(core, GenerateRequest("alone", (1, 40, 41, 42, 2), params))
    assert (alone.token_ids, alone.finish_reason) == (whole.token_ids, "stop")
    exact = run_to_completion(core, constrained("exact", choice, 0.0, max_tokens=len(whole.token_ids)))
    assert (exact.token_ids, exact.finish_reason) == (whole.token_ids, "stop")
    short = run_to_completion(core, constrained("short", choice, 0.0, max_tokens=len(whole.token_ids) - 1))
    assert (short.token_ids, short.finish_reason) == (whole.token_ids[:-1], "length")


def assert_own_rows(masks, rows: list) -> None:
    assert masks is not None
    bits = masks.result().bits.cpu()  # [B, W]
    assert bits.shape[0] == len(rows)
    for row, grammar in zip(bits, rows):
        alone = torch.frombuffer(bytearray(grammar.matcher.compute_bitmask()), dtype=torch.int32) \
            if grammar is not None else torch.full_like(row, -1)  # a row without a grammar allows every token
        assert torch.equal(row, alone)
