"""A GGUF file's metadata and tensor table, read from the memory-mapped file; tensor data is left
in the map until the loader reads it.

The gguf package's GGUFReader is not used: it builds two numpy views for every element of every
metadata array, and a Qwen-sized vocabulary (151k tokens, 151k merges, 151k token types) made each
open take 6-12 s and ~0.5 GB. Here numeric arrays are read in one piece, and arrays of strings,
which nothing here needs (transformers reads the vocabulary itself, once: tokenizer_cache.py), are
walked over without being decoded, so opening that file takes a fraction of a second. Tensors are
the arrays GGUFReader gives (same dtype and shape), so the gguf package's dequantizers take them.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # v1 counted in 32 bits; llama.cpp has written v3 since 2023
# metadata value types of a fixed size, as struct (and numpy) spell them, little-endian
_SCALARS = {GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
            GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
            GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
            GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d"}
# GGML types whose tensors are arrays of values; every other type is bytes (blocks, and BF16, which
# numpy has no dtype for), one row of bytes per row of values
_VALUE_TYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                GGMLQuantizationType.I64: np.int64}


@dataclass(frozen=True)
class UnreadStrings:
    """A metadata array of strings, walked over but not decoded (a vocabulary, its merges)."""
    count: int


class GgufTensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # in ggml's order: the length of a row first
    n_elements: int
    data: np.ndarray  # a view of the map: values [rows..., row] or, for blocks, bytes [rows..., row bytes]


class GgufFile:
    """`metadata`: key -> value (numbers and strings as Python values, a lone float32 as the shortest
    decimal that rounds to it, i.e. the value the converter was given; arrays as lists; arrays of
    strings as UnreadStrings); `tensors`: name -> GgufTensor. ValueError if the file is not a GGUF
    this reads (its message names no path: the caller's does)."""

    def __init__(self, path: str | Path) -> None:
        header = _Cursor(np.memmap(path, mode="r", dtype=np.uint8))
        if bytes(header.buffer[:4]) != _MAGIC:
            raise ValueError(f"not a GGUF file: it does not start with {_MAGIC!r}")
        self.metadata: dict[str, Any] = {}
        try:
            version, tensor_count, kv_count = header.unpack("<4xIQQ")
            if version & 0xFFFF == 0:  # the version's bytes swapped
                raise ValueError("a big-endian GGUF file: only little-endian ones are supported")
            if version not in _VERSIONS:
                raise ValueError(f"GGUF version {version}; supported: {', '.join(map(str, _VERSIONS))}")
            for _ in range(kv_count):
                key = header.string()
                self.metadata[key] = header.value(GGUFValueType(header.unpack("<I")[0]))
            table = [header.tensor_info() for _ in range(tensor_count)]
        except struct.error:
            raise ValueError("the GGUF header ends early: the file is cut short or damaged") from None
        alignment = self.metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        data_start = -(-header.pos // alignment) * alignment  # the table, padded to the alignment
        self.tensors = {name: _tensor(header.buffer, name, dims, ggml_type, data_start + offset)
                        for name, dims, ggml_type, offset in table}
        if len(self.tensors) != len(table):
            raise ValueError("the GGUF file names a tensor twice")


class _Cursor:
    """Reads the header's fields one after another."""

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.pos = 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (length,) = self.unpack("<Q")
        self.pos += length
        return bytes(self.buffer[self.pos - length:self.pos]).decode("utf-8")

    def value(self, value_type: GGUFValueType) -> Any:
        if value_type == GGUFValueType.FLOAT32:
            return float(str(np.float32(self.unpack("<f")[0])))
        if value_type in _SCALARS:
            return self.unpack(_SCALARS[value_type])[0]
        if value_type == GGUFValueType.STRING:
            return self.string()
        item_type, count = self.unpack("<IQ")  # an array: the type of its items, and how many
        item_type = GGUFValueType(item_type)
        if item_type in _SCALARS:
            values = np.frombuffer(self.buffer, dtype=_SCALARS[item_type], count=count, offset=self.pos)
            self.pos += values.nbytes
            return values.tolist()
        if item_type == GGUFValueType.STRING:
            for _ in range(count):  # each string's length is before it: nothing to do but walk them
                self.pos += 8 + struct.unpack_from("<Q", self.buffer, self.pos)[0]
            return UnreadStrings(count)
        return [self.value(item_type) for _ in range(count)]  # arrays of arrays

    def tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self.string()
        (n_dims,) = self.unpack("<I")
        dims = self.unpack(f"<{n_dims}Q")
        ggml_type, offset = self.unpack("<IQ")
        return name, dims, GGMLQuantizationType(ggml_type), offset


def _tensor(data: np.ndarray, name: str, dims: tuple[int, ...], ggml_type: GGMLQuantizationType,
            start: int) -> GgufTensor:
    n_elements = int(np.prod(dims))
    block, block_bytes = GGML_QUANT_SIZES[ggml_type]
    shape = tuple(reversed(dims))  # numpy's order: the row last
    dtype = _VALUE_TYPES.get(ggml_type)
    if dtype is None:
        dtype, shape = np.uint8, quant_shape_to_byte_shape(shape, ggml_type)
    count = n_elements // block * block_bytes // np.dtype(dtype).itemsize
    return GgufTensor(name, ggml_type, dims, n_elements,
                      np.frombuffer(data, dtype=dtype, count=count, offset=start).reshape(shape))
