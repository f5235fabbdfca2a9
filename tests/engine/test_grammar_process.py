"""The grammar process's side of the protocol, run in this process: a step's new matchers compile,
its tokens are consumed before its rows are filled, a step without its rows reuses the last step's,
rows without a grammar allow every token, the reply names only the matchers that completed or failed,
and freed matchers are gone. (tests/engine/test_structured.py drives the real process through MaskFiller.)"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import llguidance
import psutil
import pytest
import torch
from transformers import AutoTokenizer

from moe_serve.engine.grammar_process import SLOTS, MatcherHost
from moe_serve.engine.messages import StructuredOutput
from moe_serve.engine.structured import Grammars, grammar_text
from tests.server.tiny_tokenizer import build_tiny_tokenizer

ROWS = 4


@pytest.fixture(scope="module")
def grammars(tmp_path_factory: pytest.TempPathFactory) -> Grammars:
    path = tmp_path_factory.mktemp("grammar-process")
    build_tiny_tokenizer(path)
    return Grammars(lambda: AutoTokenizer.from_pretrained(path))


def host_with_rows(grammars: Grammars, tmp_path: Path) -> tuple[MatcherHost, torch.Tensor]:
    """A MatcherHost whose rows [SLOTS, ROWS, W] are also a tensor here, as the engine maps them."""
    host = MatcherHost(conn=None)
    host.handle("tokenizer", *grammars.tokenizer_spec)
    width = (grammars.tokenizer.vocab_size + 31) // 32
    path = tmp_path / "rows"
    path.write_bytes(bytes(SLOTS * ROWS * width * 4))
    host._map(ROWS, width * 4, os.open(path, os.O_RDWR))
    return host, torch.frombuffer(host.memory, dtype=torch.int32).view(SLOTS, ROWS, width)


def alone(grammars: Grammars, structured: StructuredOutput, tokens: list[int], width: int) -> torch.Tensor:
    matcher = llguidance.LLMatcher(grammars.tokenizer, grammar_text(structured))
    assert all(matcher.consume_token(t) for t in tokens)
    return torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)[:width]


def test_tokens_are_consumed_before_the_rows_are_filled(grammars: Grammars, tmp_path: Path) -> None:
    host, slots = host_with_rows(grammars, tmp_path)
    regex, choice = StructuredOutput("regex", "ab+"), StructuredOutput("choice", '["a", "bb"]')
    new = [(7, grammar_text(regex)), (9, grammar_text(choice))]
    assert host.step(new, [], [(7, 0), (9, 2)], None, 3, 0) == ({}, {})
    width = slots.shape[-1]
    assert torch.equal(slots[0, 0], alone(grammars, regex, [], width))
    assert torch.equal(slots[0, 1], torch.full((width,), -1, dtype=torch.int32))  # no grammar: every token
    assert torch.equal(slots[0, 2], alone(grammars, choice, [], width))
    [a] = grammars.tokenizer.tokenize_str("a")
    # the same rows: only the tokens travel; "a" completes the choice, at its first token
    assert host.step([], [], None, [a, a], 3, 1) == ({9: 1}, {})
    assert torch.equal(slots[1, 0], alone(grammars, regex, [a], width))
    assert torch.equal(slots[1, 2], alone(grammars, choice, [a], width))


def test_a_matcher_that_fails_is_named_and_the_others_go_on(grammars: Grammars, tmp_path: Path) -> None:
    host, slots = host_with_rows(grammars, tmp_path)
    regex = StructuredOutput("regex", "ab+")
    new = [(1, grammar_text(regex)), (2, grammar_text(regex)), (3, '{"grammars": "not a list"}')]
    _, errors = host.step(new, [], [(1, 0), (2, 1), (3, 2)], None, 3, 0)
    assert set(errors) == {3}
    [a] = grammars.tokenizer.tokenize_str("a")
    [b] = grammars.tokenizer.tokenize_str("b")
    _, errors = host.step([], [], [(1, 0), (2, 1)], [a, b], 2, 1)  # "b" cannot start "ab+"
    assert set(errors) == {2} and errors[2]
    assert torch.equal(slots[1, 0], alone(grammars, regex, [a], slots.shape[-1]))


def test_freed_matchers_are_gone(grammars: Grammars, tmp_path: Path) -> None:
    host, _ = host_with_rows(grammars, tmp_path)
    text = grammar_text(StructuredOutput("regex", "ab+"))
    host.step([(1, text), (2, text)], [], [(1, 0), (2, 1)], None, 2, 0)
    host.step([], [1], [(2, 0)], None, 1, 1)
    assert set(host.matchers) == set(host.consumed) == {2}


def test_the_process_ends_with_an_engine_that_dies_without_closing(tmp_path: Path) -> None:
    """An engine killed (no close) leaves no grammar process behind: the socket's end is its cue."""
    build_tiny_tokenizer(tmp_path)
    script = f"""
import os, sys, torch
from transformers import AutoTokenizer
from moe_serve.engine.messages import StructuredOutput
from moe_serve.engine.structured import Grammars, MaskFiller
grammars = Grammars(lambda: AutoTokenizer.from_pretrained({str(tmp_path)!r}))
filler = MaskFiller()
filler.pending([grammars.matcher(StructuredOutput("regex", "ab+"))], torch.device("cpu")).result()
print(grammars.grammar_process.child.pid, flush=True)
os._exit(0)
"""
    engine = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            cwd=Path(__file__).resolve().parents[2])
    child = int(engine.stdout.split()[-1])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and psutil.pid_exists(child) and \
            psutil.Process(child).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
