"""GgufFile reads what the gguf package's GGUFReader reads, less the strings of its string arrays: every
metadata value, and every tensor's type, shape and data as the same array."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFValueType

from moe_serve.engine.gguf.reader import GgufFile, UnreadStrings
from tests.engine.gguf.gguf_tokenizers import gguf_with_tokenizer


@pytest.mark.parametrize("expert_type,weight_type", [("Q4_K", "Q8_0"), ("Q6_K", "BF16"), ("F16", "F32")])
def test_metadata_and_tensors_are_the_gguf_packages(tmp_path: Path, expert_type: str, weight_type: str) -> None:
    gguf_file = gguf_with_tokenizer("qwen2", tmp_path, expert_type=expert_type, weight_type=weight_type,
                                    hidden_size=256, moe_intermediate_size=256)
    ours, reference = GgufFile(gguf_file), GGUFReader(gguf_file)
    fields = {key: field for key, field in reference.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        if field.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.STRING]:
            assert ours.metadata[key] == UnreadStrings(len(field.data)), key
        elif field.types == [GGUFValueType.FLOAT32]:  # the decimal the converter was given
            assert ours.metadata[key] == float(str(np.float32(field.contents()))), key
        else:
            assert ours.metadata[key] == field.contents(), key
    assert list(ours.tensors) == [t.name for t in reference.tensors]
    for want in reference.tensors:
        got = ours.tensors[want.name]
        assert (got.tensor_type, got.shape, got.n_elements) == (want.tensor_type, tuple(want.shape), want.n_elements)
        assert got.data.dtype == want.data.dtype and got.data.shape == want.data.shape
        np.testing.assert_array_equal(got.data, want.data)
    assert {t.tensor_type.name for t in ours.tensors.values()} >= {expert_type, weight_type}


def _cut_short(path: Path) -> bytes:
    gguf_with_tokenizer("qwen2", path.parent / "whole")
    return (path.parent / "whole" / "model.gguf").read_bytes()[:2000]  # inside the vocabulary


@pytest.mark.parametrize("content,error", [
    (lambda path: b"PK\x03\x04" + bytes(60), "not a GGUF file"),
    (lambda path: b"GGUF" + (3).to_bytes(4, "big") + bytes(16), "a big-endian GGUF file"),
    (lambda path: b"GGUF" + (1).to_bytes(4, "little") + bytes(16), "GGUF version 1; supported: 2, 3"),
    (_cut_short, "the GGUF header ends early: the file is cut short or damaged"),
], ids=["zip", "big-endian", "v1", "cut-short"])
def test_a_file_this_cannot_read_is_refused_by_name(tmp_path: Path, content, error: str) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(content(path))
    with pytest.raises(ValueError, match=error):
        GgufFile(path)
