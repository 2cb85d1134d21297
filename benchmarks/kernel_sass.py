"""The instructions of the experts' Triton kernels as an sm90 GPU runs them, counted on
any machine: no GPU needed.

    python benchmarks/kernel_sass.py [--kernels direct_gate_up,direct_down,gate_up,down]
        [--format mxfp4] [--dtype bfloat16] [--tiles 16x512x2,128x128x4] [--block-m 16]

Each kernel is compiled by Triton for the CUDA target (``--arch``, its bundled ptxas)
and disassembled (its bundled nvdisasm). The K loop, the longest backward branch of
the SASS, is counted by opcode; divided by the weights one lane covers per iteration
(the gate and the up tile for the gate-up kernels) it gives instructions per weight.
Where a kernel is issue-bound that number sets its time: a scheduler issues one
instruction a clock, so an H200 (132 SMs x 4 schedulers x 32 lanes, about 1.98 GHz)
covers about 3.3e13 / n weights a second at n per weight. The direct MXFP4 gate-up
kernel held 14 and took 29.1 us for 66 M weights (H200, 2026-11-28); 14 predicts 28.

Tiles are ``BLOCK_NxBLOCK_KxWARPS``; tiled kernels take ``--block-m`` rows. The table
gives each kernel's loop length, instructions per weight, registers spilled to local
memory (LDL/STL in the loop) and its most frequent opcodes.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import inspect
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from weight_formats import FORMATS

from torch_moe_ops.backends.common.kernels.triton_activation import ACTIVATION_CODES
from torch_moe_ops.backends.triton.direct_kernels import (
    moe_direct_down_kernel,
    moe_direct_gate_up_kernel,
)
from torch_moe_ops.backends.triton.kernels import moe_down_weighted_kernel, moe_gate_up_act_kernel
from torch_moe_ops.backends.triton.quant_tiles import format_codes

# name: (kernel, weight tiles per K step, whether it takes BLOCK_M rows)
KERNELS = {
    "direct_gate_up": (moe_direct_gate_up_kernel, 2, False),
    "direct_down": (moe_direct_down_kernel, 1, False),
    "gate_up": (moe_gate_up_act_kernel, 2, True),
    "down": (moe_down_weighted_kernel, 1, True),
}
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# Pointer arguments that hold weights or their scales, by kernel argument name.
WEIGHT_POINTERS = {"w13_ptr", "w2_ptr"}
SCALE_POINTERS = {"w13_scale_ptr", "w2_scale_ptr"}
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


@dataclasses.dataclass(frozen=True)
class LoopCount:
    """One kernel's K loop: its SASS instructions by opcode, and the weights a lane
    covers per iteration."""

    opcodes: collections.Counter
    weights_per_lane: float

    @property
    def length(self) -> int:
        return sum(self.opcodes.values())

    @property
    def per_weight(self) -> float:
        return self.length / self.weights_per_lane

    @property
    def spills(self) -> int:
        return self.opcodes["LDL"] + self.opcodes["STL"]


def _signature(kernel, fmt: str, dtype: torch.dtype, constants: dict) -> dict:
    spec = FORMATS[fmt]
    weight = TRITON_TYPES[dtype]
    if spec is not None:
        weight = "u8" if spec.weights == "mxfp4" else "fp8e4nv"
    scale = "u8" if spec is not None and spec.weights == "mxfp4" else "fp32"
    types = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constants:
            types[name] = "constexpr"
        elif name in WEIGHT_POINTERS:
            types[name] = f"*{weight}"
        elif name in SCALE_POINTERS:
            types[name] = f"*{scale}"
        elif name.startswith(("ids", "sorted_row_ids", "block_expert", "num_padded")):
            types[name] = "*i32"
        elif name in ("weights_ptr", "x_scale_ptr"):
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = f"*{TRITON_TYPES[dtype]}"
        elif name.startswith("swiglu"):
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def sass(name: str, fmt: str, dtype: torch.dtype, block_n: int, block_k: int,
         num_warps: int, block_m: int = 16, arch: int = 90) -> str:
    """The disassembled SASS of kernel ``name`` compiled for ``sm{arch}``."""
    kernel, _, tiled = KERNELS[name]
    constants = dict(format_codes(FORMATS[fmt]), BLOCK_N=block_n, BLOCK_K=block_k)
    parameters = inspect.signature(kernel.fn).parameters
    extra = dict(TOP_K=4, ACTIVATION=ACTIVATION_CODES["swiglu_oai"], HAS_BIAS=True,
                 HAS_WEIGHTS=True, DOT_PRECISION="tf32", BLOCK_M=block_m,
                 GROUP_M=1 if block_m == 16 else 8)
    constants.update({k: v for k, v in extra.items() if k in parameters})
    if not tiled:
        constants.pop("BLOCK_M", None)
    source = triton.compiler.ASTSource(fn=kernel, constexprs=constants,
                                       signature=_signature(kernel, fmt, dtype, constants))
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                              options=dict(num_warps=num_warps, num_stages=3))
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(compiled.asm["cubin"])
        return subprocess.run([os.path.join(TOOLS, "nvdisasm"), "-c", path], check=True,
                              capture_output=True, text=True).stdout


def main_loop(text: str) -> collections.Counter:
    """Opcodes of the longest loop of ``text`` (SASS): the instructions from a label to
    the last branch back to it."""
    instructions, labels = [], {}
    for line in text.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(instructions)
            continue
        found = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if found:
            instructions.append(found.group(1))
    longest = []
    for end, instruction in enumerate(instructions):
        target = re.search(r"BRA\s+\S*?(L_x_\d+)", instruction)
        if target and labels.get(target.group(1), end + 1) <= end:
            body = instructions[labels[target.group(1)]:end + 1]
            longest = max(longest, body, key=len)
    return collections.Counter(
        re.match(r"(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", op).group(1) for op in longest)


def count(name: str, fmt: str, dtype: torch.dtype, block_n: int, block_k: int,
          num_warps: int, block_m: int = 16, arch: int = 90) -> LoopCount:
    tiles = KERNELS[name][1]
    return LoopCount(main_loop(sass(name, fmt, dtype, block_n, block_k, num_warps, block_m,
                                    arch)),
                     tiles * block_n * block_k / (num_warps * 32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default="direct_gate_up,direct_down",
                        help=f"comma-separated, of {', '.join(KERNELS)}")
    parser.add_argument("--format", default="mxfp4", choices=tuple(FORMATS))
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16",
                                                                 "float32"))
    parser.add_argument("--tiles", default="16x512x2,64x128x4,128x128x8",
                        help="comma-separated BLOCK_NxBLOCK_KxWARPS")
    parser.add_argument("--block-m", type=int, default=16)
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    print(f"Triton {triton.__version__}, sm{args.arch}, {args.format}, {args.dtype}")
    print("| kernel | BLOCK_N x BLOCK_K x warps | loop instructions | per weight | spills "
          "| most frequent |")
    print("|---|---|---|---|---|---|")
    for name in args.kernels.split(","):
        for tile in args.tiles.split(","):
            block_n, block_k, num_warps = map(int, tile.split("x"))
            loop = count(name, args.format, dtype, block_n, block_k, num_warps, args.block_m,
                         args.arch)
            common = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(6))
            print(f"| {name} | {tile} | {loop.length} | {loop.per_weight:.1f} | "
                  f"{loop.spills} | {common} |", flush=True)


if __name__ == "__main__":
    main()
