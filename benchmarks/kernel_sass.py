"""The instructions of the experts' Triton kernels as an sm90 GPU runs them, counted on
any machine: no GPU needed.

    python benchmarks/kernel_sass.py [--shape gpt-oss-20b] [--format mxfp4]
        [--path direct] [--tokens 1] [--tiles 16x512x2,64x128x4] [--block-m 16]

The `triton` backend's call is made on the CPU with a stand-in launcher that records each
kernel launch instead of running it: the arguments the kernels would get at that shape
(``--shape``, one of bench_experts' SHAPES, with ``--tokens``; two experts, whose strides
are those of every expert). Each GEMM kernel is compiled from them by Triton for the CUDA
target (``--arch``, its bundled ptxas), specialised as Triton's launcher specialises (an
integer 1 a constant, integers and pointers that are multiples of 16 marked so), and
disassembled (its bundled nvdisasm). The K loop, the longest backward branch of the SASS,
is counted by opcode; divided by the weights one lane covers per iteration (the gate and
the up tile for the gate-up kernels) it gives instructions per weight.

Where a kernel is issue-bound that number sets its time: a scheduler issues one
instruction a clock, so an H200 (132 SMs x 4 schedulers x 32 lanes, about 1.98 GHz)
covers about 3.3e13 / n weights a second at n per weight.

Tiles are ``BLOCK_NxBLOCK_KxWARPS``; tiled kernels take ``--block-m`` rows. Formats whose
activations are quantized (w8a8) are not counted: their quantization kernel would run.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import re
import subprocess
import tempfile
from unittest import mock

import torch
import triton
from bench_experts import SHAPES
from triton.backends.compiler import GPUTarget
from weight_formats import FORMATS

from torch_moe_ops import quant
from torch_moe_ops.backends.triton import configs, fused

TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.uint8: "u8", torch.int32: "i32", torch.int64: "i64",
                torch.float8_e4m3fn: "fp8e4nv"}
# The GEMM kernels: how many weight tiles one K step reads (gate and up, or one).
WEIGHT_TILES = {"moe_direct_gate_up_kernel": 2, "moe_direct_down_kernel": 1,
                "moe_gate_up_act_kernel": 2, "moe_down_weighted_kernel": 1}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the kernel and its arguments, as Triton gets them."""

    kernel: triton.JITFunction
    args: tuple
    kwargs: dict


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


def launches(shape: str, fmt: str, path: str, tokens: int, config: configs.KernelConfig,
             dtype: torch.dtype = torch.bfloat16) -> list[Launch]:
    """The kernel launches of one `triton` experts call at ``shape``'s widths, recorded."""
    spec, widths = FORMATS[fmt], SHAPES[shape]
    if spec is not None and spec.activations != "none":
        raise ValueError(f"format must have unquantized activations here, got {fmt!r} "
                         f"(activations {spec.activations!r})")
    top_k, num_experts = widths.top_k, 2
    hidden, inter = widths.hidden, widths.inter
    # Values do not change the compiled kernels; shapes and strides do.
    w13 = torch.zeros(num_experts, 2 * inter, hidden, dtype=dtype)
    w2 = torch.zeros(num_experts, hidden, inter, dtype=dtype)
    x_TH = torch.zeros(tokens, hidden, dtype=dtype)
    weights_TK = torch.full((tokens, top_k), 1.0 / top_k)
    ids_TK = (torch.arange(tokens * top_k, dtype=torch.int32) % num_experts).view(tokens, top_k)
    bias = (torch.zeros(num_experts, 2 * inter, dtype=dtype),
            torch.zeros(num_experts, hidden, dtype=dtype))
    recorded = []

    def record(kernel):
        return mock.Mock(__getitem__=lambda _, grid: lambda *args, **kwargs: recorded.append(
            Launch(kernel, args, kwargs)))

    def blocks(ids, num_experts_, block_m):
        num_blocks = -(-ids.numel() // block_m) + num_experts_
        return (torch.zeros(num_blocks * block_m, dtype=torch.int32),
                torch.zeros(num_blocks, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))

    with mock.patch.object(fused, "launcher", record), \
            mock.patch.object(fused, "align_rows", blocks):
        config = dataclasses.replace(config, path=path)
        if spec is None:
            fused.experts_with_config(config, x_TH, weights_TK, ids_TK, w13, w2, *bias,
                                      "swiglu_oai", 1.702, 7.0)
        else:
            (q13, s13), (q2, s2) = (quant.quantize_weights(w, spec) for w in (w13, w2))
            fused.experts_quant_with_config(config, x_TH, weights_TK, ids_TK, q13, q2, s13,
                                            s2, *bias, spec.weights, spec.activations,
                                            spec.block_list, "swiglu_oai", 1.702, 7.0)
    return [launch for launch in recorded if launch.kernel.__name__ in WEIGHT_TILES]


def _specialized(launch: Launch, backend) -> tuple[dict, dict, dict]:
    """Signature, constants and attributes of ``launch`` as Triton's launcher sets them."""
    names = launch.kernel.arg_names
    values = dict(zip(names, launch.args), **{k: v for k, v in launch.kwargs.items()
                                               if k in names})
    signature, constants, attrs = {}, {}, {}
    for index, name in enumerate(names):
        value = values[name]
        if index in launch.kernel.constexprs:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                attrs[(index,)] = backend.parse_attr("D")
        elif isinstance(value, bool) or value is None:
            signature[name], constants[name] = "constexpr", value
        elif isinstance(value, int):
            if value == 1:
                signature[name], constants[name] = "constexpr", 1
            else:
                signature[name] = "i32" if -2 ** 31 <= value < 2 ** 31 else "i64"
                if value % 16 == 0:
                    attrs[(index,)] = backend.parse_attr("D")
        else:
            signature[name] = "fp32"
    return signature, constants, attrs


def sass(launch: Launch, arch: int = 90) -> str:
    """The disassembled SASS of ``launch``'s kernel compiled for ``sm{arch}``."""
    target = GPUTarget("cuda", arch, 32)
    signature, constants, attrs = _specialized(launch, triton.compiler.make_backend(target))
    source = triton.compiler.ASTSource(fn=launch.kernel, signature=signature,
                                       constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=target, options=dict(
        num_warps=launch.kwargs["num_warps"], num_stages=launch.kwargs["num_stages"]))
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


def count(launch: Launch, arch: int = 90) -> LoopCount:
    kwargs = launch.kwargs
    weights = WEIGHT_TILES[launch.kernel.__name__] * kwargs["BLOCK_N"] * kwargs["BLOCK_K"]
    return LoopCount(main_loop(sass(launch, arch)), weights / (kwargs["num_warps"] * 32))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt-oss-20b", choices=tuple(SHAPES))
    parser.add_argument("--format", default="mxfp4", choices=tuple(FORMATS))
    parser.add_argument("--path", default="direct", choices=("direct", "tiled"))
    parser.add_argument("--tokens", type=int, default=1)
    parser.add_argument("--tiles", default="16x512x2,64x128x4,128x128x8",
                        help="comma-separated BLOCK_NxBLOCK_KxWARPS")
    parser.add_argument("--block-m", type=int, default=16)
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--arch", type=int, default=90)
    args = parser.parse_args()
    print(f"Triton {triton.__version__}, sm{args.arch}, {args.shape}, {args.format}, bf16 "
          f"activations, {args.path} path, {args.tokens} tokens")
    print("| kernel | BLOCK_N x BLOCK_K x warps | loop instructions | per weight | spills "
          "| most frequent |")
    print("|---|---|---|---|---|---|")
    for tile in args.tiles.split(","):
        block_n, block_k, num_warps = map(int, tile.split("x"))
        config = configs.KernelConfig(BLOCK_M=args.block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                      GROUP_M=1, num_warps=num_warps, num_stages=args.stages,
                                      path=args.path)
        for launch in launches(args.shape, args.format, args.path, args.tokens, config):
            loop = count(launch, args.arch)
            common = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(6))
            print(f"| {launch.kernel.__name__} | {tile} | {loop.length} | "
                  f"{loop.per_weight:.1f} | {loop.spills} | {common} |", flush=True)


if __name__ == "__main__":
    main()
