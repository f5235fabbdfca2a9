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
import llguidance
import pytest
import torch
from transformers import AutoTokenizer

from moe_serve.engine.config import EngineConfig
from moe_serve.engine.core import EngineCore, run_to_completion
from moe_serve.engine.messages import GenerateRequest, SamplingParams, StructuredOutput
from moe_serve.engine.token_mask import TokenMask
from moe_serve.engine.grammar_process import GrammarProcess
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


def test_bad_grammar_and_broken_matcher_fail_only_their_request(core: EngineCore, tiny_model: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    rejected = core.add_request(constrained("bad", StructuredOutput("regex", "a(b"), 0.0))
    assert rejected is not None and rejected.finish_reason == "error" and "regex" in rejected.error
    good = constrained("good", StructuredOutput("regex", REGEX), 1.0, seed=5)
    broken = constrained("broken", StructuredOutput("choice", json.dumps(CHOICES)), 0.0)
    free = GenerateRequest("free", (1, 9, 8), SamplingParams(max_tokens=6, temperature=0))
    for request in (good, broken, free):
        assert core.add_request(request) is None
    # the mask bypassed: its third token one no choice goes on with, which breaks its matcher
    [hash_sign] = AutoTokenizer.from_pretrained(tiny_model).encode("#", add_special_tokens=False)
    follow = core.runtime.batch_runner.masks.follow
    broken_grammar, its_tokens = core.scheduler.find("broken").grammar, []

    def bypassed(masks, tokens):
        if broken_grammar in masks.step.grammars:
            its_tokens.append(None)
            if len(its_tokens) == 3:
                tokens = [hash_sign if g is broken_grammar else t for g, t in zip(masks.step.grammars, tokens)]
        follow(masks, tokens)

    monkeypatch.setattr(core.runtime.batch_runner.masks, "follow", bypassed)
    outputs: dict[str, list] = {"good": [], "broken": [], "free": []}
    while core.has_unfinished():
        for out in core.step():
            outputs[out.request_id].append(out)
    assert outputs["broken"][-1].finish_reason == "error" and "constrained decoding" in outputs["broken"][-1].error
    assert len(tokens(outputs["broken"])) == 3
    monkeypatch.undo()
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


def test_a_step_without_a_grammar_skips_the_mask_path(core: EngineCore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(GrammarProcess, "submit", refuse)
    monkeypatch.setattr(TokenMask, "restrict", refuse)
    reqs = [GenerateRequest(f"free{i}", (1, 9 + i, 8), SamplingParams(max_tokens=6, temperature=t, seed=i))
            for i, t in enumerate((0.0, 1.0, 0.0, 0.7))]
    for outs in run_together(core, reqs).values():
        assert outs[-1].finish_reason == "length" and not any(o.error for o in outs)


@pytest.fixture(scope="module")
def grammars(tiny_model: Path):
    grammars = Grammars(lambda: AutoTokenizer.from_pretrained(tiny_model))
    yield grammars
    grammars.close()


def test_each_filled_row_is_its_matchers_own_mask(grammars: Grammars) -> None:
    """A first step's rows, then the follow job's, after the tokens sampled (the last each row allows)."""
    matchers = [grammars.matcher(s) for s in STRUCTURED]
    rows, cpu, filler = [matchers[0], None, *matchers[1:], None], torch.device("cpu"), MaskFiller()
    masks = filler.pending(rows, cpu)
    bits = assert_own_rows(grammars, masks, rows, {})
    tokens = [last_allowed(row) for row in bits]
    filler.follow(masks, tokens)
    assert_own_rows(grammars, filler.pending(rows, cpu), rows, {g: [t] for g, t in zip(rows, tokens)})


def test_the_kept_buffer_leaves_no_row_of_an_earlier_step(grammars: Grammars) -> None:
    matchers = [grammars.matcher(s) for s in STRUCTURED * 2]
    filler = MaskFiller()
    # every row constrained (no row set to ones first); then rows whose grammar left; then a larger batch
    for rows in (matchers[:3], [None, matchers[3], None], [*matchers[:4], None, *matchers[4:]]):
        assert_own_rows(grammars, filler.pending(rows, torch.device("cpu")), rows, {})


def test_a_follow_job_consumes_the_tokens_and_fills_the_next_steps_masks(grammars: Grammars) -> None:
    matchers = [grammars.matcher(s) for s in STRUCTURED]
    rows, cpu, filler = [matchers[0], None, *matchers[1:]], torch.device("cpu"), MaskFiller()
    masks = filler.pending(rows, cpu)
    tokens = [last_allowed(row) for row in masks.result().bits]
    filler.follow(masks, tokens)
    following = filler.pending(rows, cpu)  # the same rows: the follow job's fill, after it consumed the tokens
    assert following is not None and following.tokens == [tokens[i] for i, _ in masks.step.rows]
    assert_own_rows(grammars, following, rows, {g: [t] for g, t in zip(rows, tokens)})
    filler.follow(following, [5] * len(rows))  # refused by some grammars: their next fill reports it
    reordered = [rows[2], rows[0], None, rows[3]]  # a changed batch: filled again, after the tokens are consumed
    with pytest.raises(GrammarError, match="constrained decoding failed"):
        filler.pending(reordered, cpu).result()


def test_a_settle_or_a_step_without_its_rows_reads_the_consumed_tokens(grammars: Grammars,
                                                                       tiny_model: Path) -> None:
    """A sequence that ends by length settles its grammar at once; a step that leaves a sequence out (or has
    no constrained row) still learns what its tokens did: here, each completes its grammar."""
    [a] = AutoTokenizer.from_pretrained(tiny_model).encode("a", add_special_tokens=False)
    cpu = torch.device("cpu")
    for ending in ("settle", "other rows", "no rows"):
        matchers = [grammars.matcher(StructuredOutput("regex", "a")) for _ in range(2)]
        filler = MaskFiller()
        masks = filler.pending(matchers, cpu)
        masks.result()
        filler.follow(masks, [a, a])
        if ending == "settle":
            matchers[0].settle()
        elif ending == "other rows":
            filler.pending([matchers[1]], cpu).result()
        else:
            assert filler.pending([None, None], cpu) is None
            matchers[1].settle()
        assert [g.complete_within(1) for g in matchers] == [True, True], ending


def test_a_refused_token_fails_only_its_own_matcher(grammars: Grammars) -> None:
    matchers = [grammars.matcher(s) for s in STRUCTURED[:2]]
    filler, cpu = MaskFiller(), torch.device("cpu")
    masks = filler.pending(matchers, cpu)
    bits = masks.result().bits
    refused = int((bits[0] == 0).nonzero()[0]) * 32  # 32 tokens the first grammar refuses
    filler.follow(masks, [refused, last_allowed(bits[1])])
    with pytest.raises(GrammarError, match="constrained decoding failed"):  # the step retries alone
        filler.pending(matchers, cpu).result()
    with pytest.raises(GrammarError, match="constrained decoding failed"):
        filler.pending(matchers[:1], cpu).result()
    assert_own_rows(grammars, filler.pending(matchers[1:], cpu), matchers[1:], {matchers[1]: [last_allowed(bits[1])]})


def test_a_grammar_process_that_ends_fails_its_matchers_and_another_starts(grammars: Grammars) -> None:
    matchers = [grammars.matcher(s) for s in STRUCTURED[:2]]
    filler, cpu = MaskFiller(), torch.device("cpu")
    filler.pending(matchers, cpu).result()
    ended = grammars.grammar_process
    ended.child.kill()
    ended.child.wait()
    with pytest.raises(GrammarError, match="grammar process ended"):
        filler.pending(matchers, cpu).result()
    for matcher in matchers:
        with pytest.raises(GrammarError, match="grammar process ended"):
            filler.pending([matcher], cpu).result()
    later = [grammars.matcher(s) for s in STRUCTURED[2:]]
    assert_own_rows(grammars, filler.pending(later, cpu), later, {})
    assert grammars.grammar_process is not ended


def test_an_engines_close_ends_its_grammar_process(tiny_model: Path) -> None:
    engine = EngineCore(EngineConfig(model=str(tiny_model)))
    assert engine.grammars.grammar_process is None  # no constrained request: no process was started
    engine.close()
    engine = EngineCore(EngineConfig(model=str(tiny_model)))
    reqs = [constrained(f"w{i}", STRUCTURED[i % 2], 1.0, seed=i) for i in range(4)]
    assert all(outs[-1].finish_reason == "stop" for outs in run_together(engine, reqs).values())
    child = engine.grammars.grammar_process.child
    engine.close()
    assert child.wait(timeout=10) == 0


def test_a_grammar_completed_by_the_last_allowed_token_ends_as_stop(core: EngineCore) -> None:
    """The engine learns of the completion a step late (and drops that step's token)."""
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


def last_allowed(row: torch.Tensor) -> int:
    """The largest token id a mask row [W] allows."""
    return int(torch.signbit(row.unsqueeze(-1) << torch.arange(31, -1, -1, dtype=torch.int32)).flatten().nonzero().max())


def assert_own_rows(grammars: Grammars, masks, rows: list, consumed: dict) -> torch.Tensor:
    """Each row of the masks [B, W] is what a matcher of its grammar computes alone after the tokens `consumed`
    lists for it; returns them."""
    assert masks is not None
    bits = masks.result().bits.cpu()  # [B, W]
    assert bits.shape[0] == len(rows)
    for row, grammar in zip(bits, rows):
        if grammar is None:  # a row without a grammar allows every token
            assert torch.equal(row, torch.full_like(row, -1))
            continue
        alone = llguidance.LLMatcher(grammars.tokenizer, grammar.grammar)
        assert all(alone.consume_token(t) for t in consumed.get(grammar, []))
        assert torch.equal(row, torch.frombuffer(bytearray(alone.compute_bitmask()), dtype=torch.int32)[:len(row)])
    return bits
