"""Instructions a weight in the expert kernels' gate/up loop, per expert format, from their sm_90 SASS: no GPU.

    python bench/kernel_sass.py --out bench/results/quant/kernel_sass-sm90.json
    python bench/kernel_sass.py --kernel grouped --out bench/results/quant/kernel_sass-grouped-sm90.json

The one-token expert kernels of the quantized formats are bound by the instructions that decode
their weights as much as by HBM, and a GPU session's time is short: this counts what each format's
decode costs without one. Per format, the gate/up kernel is compiled as the dispatch would launch
it at the Mixtral shape (H 4096, I 14,336) for sm_90 by `triton.compile`, with the 16-byte alignment
the JIT specializes pointers and strides to, then disassembled with the nvdisasm Triton ships:
`fused` (one token: `fused_experts._gate_up_kernel` under `fused_experts.default_config`'s tiles, the
format's tile dot where it has one), `grouped` (a batch: `grouped_experts._gate_up_kernel` under
`grouped_experts.default_config`, tiles decoded for tl.dot) or `grouped-int4` (a batch of int4
experts, as the dispatch takes it at this shape: `grouped_int4._gate_up_kernel` under `INT4_CONFIG`);
`grouped-int4-down` counts that path's down kernel instead (one chunk of I, `--formats int4`).
Counted: the SASS of the K loop's body (from the target of the longest backward branch to the
branch), divided by the weights one thread of a program reads per iteration (matrices x rows x
columns / threads: 2 matrices in gate/up). Conversions from int to float (I2F, I2FP) are listed
apart: sm_90 issues them at a fraction of an FMA's rate, so an instruction count undercounts a
loop with many.

These are static counts, a model of the ALU side; the kernels' times come from bench/quant_experts.py on
a GPU. Triton's own version builds them (the GPU image's may schedule differently).
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moe_serve.engine.experts import fused_experts, grouped_experts, grouped_int4  # noqa: E402
from moe_serve.engine.experts.activation import ExpertActivation  # noqa: E402
from moe_serve.engine.experts.formats import FORMAT_NAMES, expert_format  # noqa: E402
from moe_serve.engine.experts.formats.int4 import GROUP_SIZE  # noqa: E402

HIDDEN, INTERMEDIATE = 4096, 14336  # Mixtral's expert shape
TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
CONVERSIONS = ("I2F", "I2FP")
# the grouped kernels' block layout (grouped_experts.BlockLayout)
_BLOCK_LAYOUT = {name: "*i32" for name in ("order_ptr", "block_slot_ptr", "block_first_ptr", "block_rows_ptr",
                                           "num_blocks_ptr")}
# what both matrices' kernels take as constants at the Mixtral shape: the slots' first sections, no expert
# biases (b_ptr and bias_stride None: compile-time constants, as a launch passes them)
_SHAPE_CONSTANTS = {"H": HIDDEN, "I": INTERMEDIATE, "DATA": 0, "SCALES": 0, "b_ptr": None, "bias_stride": None,
                    "BIAS": 0, "BIASES": False}
_OPCODE = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


def compile_gate_up(quant: str, kernel: str = "fused"):
    """The gate/up kernel as the dispatch launches it at the Mixtral shape, built for sm_90; its tile
    (rows x columns, warps) and the weights a thread reads per loop iteration."""
    fmt = expert_format(quant, torch.bfloat16)
    operands = _operands(fmt)
    # top-2, silu
    format_constants = {**_SHAPE_CONSTANTS, "K": 2, "LOAD": fmt.triton_load, "COLS": fmt.triton_cols,
                        **ExpertActivation().kernel_args}
    if kernel == "fused":
        dot = fmt.triton_dot
        cfg = fused_experts.default_config(1, HIDDEN, INTERMEDIATE, dot is not None, dot is not None)
        fn = fused_experts._gate_up_kernel
        pointers = {"x_ptr": "*bf16", **operands, "ids_ptr": "*i32", "act_ptr": "*fp32"}
        constants = {**format_constants, "BLOCK_I": cfg.gate_up_rows, "BLOCK_H": cfg.gate_up_cols,
                     "DOT": fmt.triton_load if dot is None else dot, "USE_DOT": dot is not None}
        rows, cols, options = cfg.gate_up_rows, cfg.gate_up_cols, {"num_warps": cfg.gate_up_warps}
    else:  # a grouped kernel: the block layout's pointers, GroupedConfig's tiles
        pointers = {"x_ptr": "*bf16", **operands, **_BLOCK_LAYOUT, "act_ptr": "*bf16"}
        if kernel == "grouped-int4":
            cfg, fn, decode = grouped_int4.INT4_CONFIG, grouped_int4._gate_up_kernel, {"GROUP": GROUP_SIZE}
        else:
            cfg, fn = grouped_experts.default_config(HIDDEN, INTERMEDIATE), grouped_experts._gate_up_kernel
            codes = fmt.triton_codes_for(HIDDEN, cfg.gate_up_block_h)  # as grouped_experts._with_codes (bf16 x)
            decode = {"CODES": fmt.triton_load if codes is None else codes, "USE_CODES": codes is not None}
        constants = {**format_constants, "BLOCK_M": cfg.block_m, "BLOCK_I": cfg.gate_up_block_i,
                     "BLOCK_H": cfg.gate_up_block_h, **decode}
        rows, cols = cfg.gate_up_block_i, cfg.gate_up_block_h
        options = {"num_warps": cfg.gate_up_warps, "num_stages": cfg.gate_up_stages}
    compiled = _build(fn, pointers, {}, constants, options)
    return compiled, f"{rows}x{cols}, {options['num_warps']} warps", 2 * rows * cols / (options["num_warps"] * 32)


def compile_int4_down():
    """grouped_int4's down kernel as the dispatch launches it at the Mixtral shape for one chunk of I
    (a 32-token step's), built for sm_90; its tile and the weights a thread reads per loop iteration."""
    cfg = grouped_int4.INT4_CONFIG
    pointers = {"act_ptr": "*bf16", **_operands(expert_format("int4", torch.bfloat16)), "weights_ptr": "*fp32",
                "y_ptr": "*fp32", **_BLOCK_LAYOUT}
    scalars = {"pair_count": "i32", "i_chunk": "i32"}
    constants = {**_SHAPE_CONSTANTS, "i_chunk": INTERMEDIATE, "BLOCK_M": cfg.block_m, "BLOCK_H": cfg.down_block_h,
                 "BLOCK_I": cfg.down_block_i, "GROUP": GROUP_SIZE}
    options = {"num_warps": cfg.down_warps, "num_stages": cfg.down_stages}
    compiled = _build(grouped_int4._down_kernel, pointers, scalars, constants, options)
    return (compiled, f"{cfg.down_block_h}x{cfg.down_block_i}, {cfg.down_warps} warps",
            cfg.down_block_h * cfg.down_block_i / (cfg.down_warps * 32))


def _operands(fmt) -> dict:
    """The expert weights' pointers and row strides, in the format's dtypes (aligned as pointers)."""
    return {"w_ptr": f"*{_triton_dtype(fmt.data_dtype)}", "s_ptr": f"*{_triton_dtype(fmt.scale_dtype or fmt.data_dtype)}",
            "row_stride": "i64", "scale_stride": "i64"}


def _build(fn, pointers: dict, scalars: dict, constants: dict, options: dict):
    """fn compiled for TARGET: pointers (and strides) 16-byte aligned, as the JIT specializes them; scalars
    as given."""
    # a constexpr of the kernel's is a constant, and so is a None (as the JIT takes it); the rest run-time values
    constexprs = {param.name for param in fn.params if param.is_constexpr}
    constants = {name: value for name, value in constants.items() if name in constexprs or value is None}
    signature = {name: pointers.get(name) or scalars[name] for name in fn.arg_names
                 if name not in constants and (name in pointers or name in scalars)}
    aligned = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in signature if name in pointers}
    source = ASTSource(fn=fn, signature={**signature, **{name: "constexpr" for name in constants}},
                       constexprs=constants, attrs=aligned)
    return triton.compile(source, target=TARGET, options=options)


def _triton_dtype(dtype: torch.dtype) -> str:
    return {torch.uint8: "u8", torch.int8: "i8", torch.float16: "fp16", torch.bfloat16: "bf16",
            torch.float32: "fp32", torch.int32: "i32", torch.float8_e4m3fn: "fp8e4nv"}[dtype]


def loop_body(sass: str) -> list[str]:
    """The opcodes from the target of the longest backward branch to the branch (the K loop)."""
    lines = sass.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L_x_\d+:", line.strip())}
    spans = [(labels[m.group(1)], i) for i, line in enumerate(lines)
             if (m := _BRANCH.search(line)) and labels.get(m.group(1), i) < i]
    if not spans:
        raise ValueError("no loop in the kernel's SASS")
    start, end = max(spans, key=lambda span: span[1] - span[0])
    return [m.group(1) for line in lines[start:end + 1] if (m := _OPCODE.match(line))]


def count(quant: str, kernel: str = "fused") -> dict:
    if kernel == "grouped-int4-down":
        compiled, tile, per_thread = compile_int4_down()
    else:
        compiled, tile, per_thread = compile_gate_up(quant, kernel)
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        sass = subprocess.run([str(nvdisasm), "-c", cubin.name], capture_output=True, text=True, check=True).stdout
    opcodes = collections.Counter(loop_body(sass))
    total = sum(opcodes.values())
    return {"format": quant, "kernel": kernel, "tile": tile,
            "tile_dot": kernel == "fused" and expert_format(quant, torch.bfloat16).triton_dot is not None,
            "weights_per_thread_per_iteration": per_thread, "loop_instructions": total,
            "instructions_per_weight": total / per_thread,
            "conversions_per_weight": sum(opcodes[c] for c in CONVERSIONS) / per_thread,
            "opcodes": dict(opcodes.most_common(12))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--formats", default=",".join(name for name in FORMAT_NAMES))
    parser.add_argument("--kernel", choices=["fused", "grouped", "grouped-int4", "grouped-int4-down"], default="fused")
    args = parser.parse_args()
    rows = []
    for quant in args.formats.split(","):
        row = count(quant, args.kernel)
        print(json.dumps({k: v for k, v in row.items() if k != "opcodes"}), flush=True)
        rows.append(row)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "triton": triton.__version__,
                                          "target": "sm_90", "shape": [HIDDEN, INTERMEDIATE], "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
