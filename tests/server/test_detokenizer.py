"""Incremental detokenisation == one-shot decode, and no delta ends inside a UTF-8 character."""
from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_tokenizer import MULTIBYTE, build_tiny_tokenizer

from moe_serve.server.detokenizer import REPLACEMENT, IncrementalDetokenizer
from moe_serve.server.tokenizer import Tokenizer

VOCAB = 128  # the tiny checkpoints' vocabulary; ids past the tokenizer's decode to nothing


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path = tmp_path_factory.mktemp("tok")
    build_tiny_tokenizer(path)
    return Tokenizer(str(path))


@pytest.fixture(scope="module", params=["rust", "python"])
def detokenizer(request: pytest.FixtureRequest, tokenizer: Tokenizer) -> Callable[[], IncrementalDetokenizer]:
    """The tokenizers library's DecodeStream (fast tokenizers), or the Python window (the others)."""
    backend = tokenizer.backend if request.param == "rust" else None
    assert request.param == "python" or backend is not None
    return lambda: IncrementalDetokenizer(tokenizer.decode, backend)


def _stream(make: Callable[[], IncrementalDetokenizer], ids: list[int]) -> list[str]:
    detok = make()
    return [detok.add(i) for i in ids] + [detok.flush()]


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=40))
def test_random_tokens_stream_to_the_one_shot_decode(tokenizer: Tokenizer, detokenizer, ids: list[int]) -> None:
    deltas = _stream(detokenizer, ids)
    one_shot = tokenizer.decode(ids)
    # HF's byte-fallback decoder turns EVERY byte of a sequence containing invalid UTF-8 into
    # U+FFFD (bytes C3 80 80 -> three of them, though C3 80 alone is 'À'), so only ids that decode
    # to valid text decode compositionally; for the rest only the no-split property is checked.
    if REPLACEMENT not in one_shot:
        assert "".join(deltas) == one_shot
    assert not any(d.endswith(REPLACEMENT) for d in deltas[:-1])


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=MULTIBYTE + "ab z", max_size=30))
def test_multibyte_text_is_never_split(tokenizer: Tokenizer, detokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(detokenizer, ids)
    assert "".join(deltas) == text
    assert REPLACEMENT not in "".join(deltas)


def test_byte_tokens_of_one_emoji_come_out_as_one_delta(tokenizer: Tokenizer, detokenizer) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) == 4  # the four UTF-8 bytes, one byte-fallback token each
    assert _stream(detokenizer, ids) == ["", "", "", "🙂", ""]


def test_a_character_cut_off_at_the_end_is_flushed_as_replacement(tokenizer: Tokenizer, detokenizer) -> None:
    ids = tokenizer.encode("a🙂", add_special_tokens=False)
    deltas = _stream(detokenizer, ids[:-1])  # the emoji's last byte never comes
    assert deltas[:-1] == ["a", "", "", ""] and deltas[-1] and set(deltas[-1]) == {REPLACEMENT}


def test_special_tokens_are_not_text(tokenizer: Tokenizer, detokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("hi", add_special_tokens=False) + [eos]
    assert "".join(_stream(detokenizer, ids)) == "hi"


def test_a_run_that_decode_stream_refuses_goes_on_through_the_window(tokenizer: Tokenizer) -> None:
    """tokenizers' DecodeStream raises "Invalid prefix encountered" on some runs of invalid UTF-8
    bytes (these ids, at 74); the window takes over from that token and the text goes on."""
    ids = [59, 117, 109, 106, 74, 69, 71, 59, 1, 78, 49, 80]
    rust = IncrementalDetokenizer(tokenizer.decode, tokenizer.backend)
    deltas = [rust.add(i) for i in ids] + [rust.flush()]
    assert rust._stream is None  # it did give up here
    python = IncrementalDetokenizer(tokenizer.decode)
    assert "".join(deltas) == "".join([python.add(i) for i in ids] + [python.flush()])
    assert not any(d.endswith(REPLACEMENT) for d in deltas[:-1])
