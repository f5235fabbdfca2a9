"""How one expert is packed into a single contiguous row of bytes, whatever its weight format.

A row holds the fused gate+up projection [2I, H] (gate rows first) and the down projection
[H, I], each encoded by its format (formats/: one for both, or the down projection's own, as a
GGUF Q4_K_M file keeps some layers' ffn_down in Q6_K), then their scales if the formats have any,
then, for experts with biases (gpt-oss), gate_up's [2I] and down's [H] in the compute dtype:

    [gate_up data | down data | gate_up scales | down scales | gate_up bias | down bias]

Each section starts on a 16-byte boundary and the row is padded to one, so in any row of a
[S, row] allocation every section views as its own dtype (and the kernels' loads stay aligned).
One row means one expert moves host->device in one copy and occupies exactly one expert slot: the
store, the cache and the copies only ever see rows; compute decodes them through the layout.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from moe_serve.engine.experts.activation import ExpertActivation
from moe_serve.engine.experts.formats.base import ExpertFormat
from moe_serve.engine.experts.formats.plain import Plain

MATRICES = ("gate_up", "down")
BIAS_SUFFIX = "_bias"  # write()'s part names of biases: gate_bias, up_bias, gate_up_bias, down_bias
_ALIGN = 16


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class Section:
    """One encoded matrix, or its scales, inside a row."""

    offset: int  # bytes from the row's start
    rows: int
    cols: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.dtype.itemsize

    def view(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [..., numel] (any row dtype) -> this section of each, [..., self.rows, self.cols]."""
        raw = rows.view(torch.uint8)[..., self.offset : self.offset + self.nbytes]
        return raw.view(self.dtype).unflatten(-1, (self.rows, self.cols))


@dataclass(frozen=True)
class ExpertLayout:
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype  # the compute dtype: activations, and what the weights decode to
    format: ExpertFormat | None = None  # None: Plain(dtype), the weights stored as they are computed
    down_format: ExpertFormat | None = None  # the down projection's, where it differs; None: `format`
    activation: ExpertActivation = field(default_factory=ExpertActivation)  # what gate and up give down
    biases: bool = False  # each projection adds a bias (gpt-oss): the 'gate_up.bias' and 'down.bias' sections

    def __post_init__(self) -> None:
        if self.format is None:
            object.__setattr__(self, "format", Plain(self.dtype))
        if self.down_format == self.format:  # one spelling of a layout: replace(layout, format=...) changes both
            object.__setattr__(self, "down_format", None)

    def format_of(self, matrix: str) -> ExpertFormat:
        """The format 'gate_up' or 'down' is encoded in."""
        return self.down_format if matrix == "down" and self.down_format is not None else self.format

    @property
    def formats(self) -> tuple[ExpertFormat, ...]:
        """The distinct formats of the row: one, or gate_up's and down's."""
        return (self.format,) if self.down_format is None else (self.format, self.down_format)

    @cached_property
    def quantized(self) -> bool:
        """Whether a matrix is stored other than as its compute dtype: torch then decodes it whole to
        read it (weights()), where a plain one is a view."""
        return any(fmt != Plain(self.dtype) for fmt in self.formats)

    def shape(self, matrix: str) -> tuple[int, int]:
        """[N, K] of a matrix: outputs, and the reduction dim its format encodes along."""
        h, i = self.hidden_size, self.intermediate_size
        return (2 * i, h) if matrix == "gate_up" else (h, i)

    @cached_property
    def sections(self) -> dict[str, Section]:
        """'gate_up', 'down', where their formats have scales 'gate_up.scales', 'down.scales', and
        with biases 'gate_up.bias' [1, 2I], 'down.bias' [1, H]."""
        found, offset = {}, 0

        def add(name: str, rows: int, cols: int, dtype: torch.dtype) -> None:
            nonlocal offset
            found[name] = Section(offset, rows, cols, dtype)
            offset = _aligned(offset + found[name].nbytes)

        for scales in (False, True):
            for matrix in MATRICES:
                fmt, (n, k) = self.format_of(matrix), self.shape(matrix)
                dtype = fmt.scale_dtype if scales else fmt.data_dtype
                if dtype is None:
                    continue
                fmt.check_shape(n // 2 if matrix == "gate_up" else n, k)  # gate and up are encoded apart
                if scales:
                    add(matrix + ".scales", fmt.scale_rows(n), fmt.scale_cols(k), dtype)
                else:
                    add(matrix, n, fmt.data_cols(k), dtype)
        if self.biases:  # never quantized: one vector an expert, nothing worth saving, added in the compute dtype
            for matrix in MATRICES:
                add(matrix + ".bias", 1, self.shape(matrix)[0], self.dtype)
        return found

    # row_dtype, nbytes and numel are read per copied expert (ExpertStore.row); a layout is frozen,
    # so each is worked out once
    @cached_property
    def row_dtype(self) -> torch.dtype:
        """The element of a row: the data's own dtype when that is all there is (an unquantized row
        is a plain weight array), bytes otherwise."""
        dtypes = {s.dtype for s in self.sections.values()}
        return dtypes.pop() if len(dtypes) == 1 else torch.uint8

    @cached_property
    def nbytes(self) -> int:
        """Bytes of one expert's row: what one expert slot holds and one miss copies."""
        return _aligned(max(s.offset + s.nbytes for s in self.sections.values()))

    @cached_property
    def numel(self) -> int:
        """Elements of row_dtype per row."""
        return self.nbytes // self.row_dtype.itemsize

    def weights(self, rows: torch.Tensor, matrix: str) -> torch.Tensor:
        """rows [..., numel] -> the matrix [..., N, K] in the compute dtype: a view of the row when
        the format stores it as computed, decoded otherwise."""
        scales = self.sections.get(matrix + ".scales")
        return self.format_of(matrix).decode(self.sections[matrix].view(rows),
                                             None if scales is None else scales.view(rows), self.shape(matrix)[1],
                                             self.dtype)

    def gate_up(self, rows: torch.Tensor) -> torch.Tensor:
        """The fused gate+up projection, [..., 2I, H] (gate rows first)."""
        return self.weights(rows, "gate_up")

    def down(self, rows: torch.Tensor) -> torch.Tensor:
        """The down projection, [..., H, I]."""
        return self.weights(rows, "down")

    def bias(self, rows: torch.Tensor, matrix: str) -> torch.Tensor | None:
        """rows [..., numel] -> the bias of 'gate_up' [..., 2I] (gate's first) or 'down' [..., H], a
        view of the row; None where the layout has no biases."""
        section = self.sections.get(matrix + ".bias")
        return None if section is None else section.view(rows)[..., 0, :]

    def write(self, rows: torch.Tensor, part: str, w: torch.Tensor) -> None:
        """Encode HF-shaped weights of one part into rows [..., numel]: gate or up [..., I, H], down
        [..., H, I] or gate_up [..., 2I, H]; or store a bias: gate_bias or up_bias [..., I],
        gate_up_bias [..., 2I], down_bias [..., H]. A format's rows (or blocks of rows) are
        independent, so parts encode apart."""
        if part.endswith(BIAS_SUFFIX):
            self._write_bias(rows, part.removesuffix(BIAS_SUFFIX), w)
            return
        matrix, span = self._part(part)
        expected = (*self.sections[matrix].view(rows)[..., span, :].shape[:-1], self.shape(matrix)[1])
        if tuple(w.shape) != expected:
            raise ValueError(f"expert weight has shape {tuple(w.shape)}, expected {expected}")
        self.write_encoded(rows, part, *self.format_of(matrix).encode(w))

    def write_encoded(self, rows: torch.Tensor, part: str, data: torch.Tensor, scales: torch.Tensor | None) -> None:
        """Store one part already encoded in the layout's format (a quantized checkpoint's experts,
        kept as published): data [..., rows of the part, data_cols], scales [..., scale rows, scale_cols]."""
        matrix, span = self._part(part)
        fmt = self.format_of(matrix)
        targets = [(self.sections[matrix], span, data)]
        if fmt.scale_dtype is not None:
            if scales is None:
                raise ValueError(f"{fmt.name} experts need scales")
            scale_span = slice(*(None if i is None else fmt.scale_rows(i) for i in (span.start, span.stop)))
            targets.append((self.sections[matrix + ".scales"], scale_span, scales))
        for section, rows_of_part, src in targets:
            dst = section.view(rows)[..., rows_of_part, :]
            if tuple(src.shape) != tuple(dst.shape) or src.dtype != dst.dtype:
                raise ValueError(f"encoded expert weight is {tuple(src.shape)} {src.dtype}, "
                                 f"expected {tuple(dst.shape)} {dst.dtype}")
            dst.copy_(src)

    def _write_bias(self, rows: torch.Tensor, part: str, b: torch.Tensor) -> None:
        matrix, span = self._part(part)
        section = self.sections.get(matrix + ".bias")
        if section is None:
            raise ValueError(f"{part}{BIAS_SUFFIX} given for experts without biases")
        dst = section.view(rows)[..., 0, span]
        if tuple(b.shape) != tuple(dst.shape):
            raise ValueError(f"expert bias has shape {tuple(b.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(b)

    def _part(self, part: str) -> tuple[str, slice]:
        """The matrix a part lives in and its rows there: gate and up are the halves of gate_up."""
        matrix = "down" if part == "down" else "gate_up"
        n = self.shape(matrix)[0]
        return matrix, {"gate": slice(0, n // 2), "up": slice(n // 2, n)}.get(part, slice(None))

    def pack_into(self, row: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Write HF-shaped weights (gate/up [I, H], down [H, I]) into one packed row."""
        for part, w in (("gate", gate), ("up", up), ("down", down)):
            self.write(row, part, w)

    def element_offset(self, section: str) -> int:
        """Where a section starts, in elements of its own dtype (0 for a section the format lacks)."""
        found = self.sections.get(section)
        return 0 if found is None else found.offset // found.dtype.itemsize

    def kernel_views(self, expert_slots: torch.Tensor, matrix: str) -> tuple[torch.Tensor, torch.Tensor]:
        """expert_slots [S, numel] as the elements of a matrix's data and of its scales (the data view
        again when there are none): two views of one allocation, which the kernels index with
        element_offset."""
        fmt, raw = self.format_of(matrix), expert_slots.view(torch.uint8)
        data = raw.view(fmt.data_dtype)
        return data, data if fmt.scale_dtype is None else raw.view(fmt.scale_dtype)

    def bias_kernel_view(self, expert_slots: torch.Tensor) -> torch.Tensor | None:
        """expert_slots [S, numel] as elements of the biases' dtype, which the kernels index with
        element_offset; None without biases (the kernels then compile without them)."""
        return expert_slots.view(torch.uint8).view(self.dtype) if self.biases else None

    @property
    def format_names(self) -> str:
        """'q4_k', or gate/up's and down's: 'q4_k with down q6_k'."""
        return " with down ".join(fmt.name for fmt in self.formats)

    def describe_formats(self) -> str:
        return "; down: ".join(fmt.describe() for fmt in self.formats)

    def describe(self) -> str:
        return f"{self.describe_formats()}, {self.nbytes} bytes per expert"
