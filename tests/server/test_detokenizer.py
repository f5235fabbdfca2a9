"""Incremental detokenisation == one-shot decode, and no delta ends inside a UTF-8 character."""
from __future__ import annotations

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


def _stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer.decode)
    return [detok.add(i) for i in ids] + [detok.flush()]


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(min_value=0, max_value=VOCAB - 1), max_size=40))
def test_random_tokens_stream_to_the_one_shot_decode(tokenizer: Tokenizer, ids: list[int]) -> None:
    deltas = _stream(tokenizer, ids)
    one_shot = tokenizer.decode(ids)
    # HF's byte-fallback decoder turns EVERY byte of a sequence containing invalid UTF-8 into
    # U+FFFD (bytes C3 80 80 -> three of them, though C3 80 alone is 'À'), so only ids that decode
    # to valid text decode compositionally; for the rest only the no-split property is checked.
    if REPLACEMENT not in one_shot:
        assert "".join(deltas) == one_shot
    assert not any(d.endswith(REPLACEMENT) for d in deltas[:-1])


@settings(max_examples=200, deadline=None)
@given(text=st.text(alphabet=MULTIBYTE + "ab z", max_size=30))
def test_multibyte_text_is_never_split(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = _stream(tokenizer, ids)
    assert "".join(deltas) == text
    assert REPLACEMENT not in "".join(deltas)


def test_byte_tokens_of_one_emoji_come_out_as_one_delta(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) == 4  # the four UTF-8 bytes, one byte-fallback token each
    assert _stream(tokenizer, ids) == ["", "", "", "🙂", ""]


def test_special_tokens_are_not_text(tokenizer: Tokenizer) -> None:
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("hi", add_special_tokens=False) + [eos]
    assert "".join(_stream(tokenizer, ids)) == "hi"
