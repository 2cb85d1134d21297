"""Tune the Triton experts configs for the benchmark's model shapes on this GPU.

    python benchmarks/tune_shapes.py --out DIR [--shapes qwen3-30b-a3b,olmoe] [--tokens 1,16]
        [--formats bf16,fp8_channel]

Runs `torch_moe_ops.tune` once per shape of bench_experts.SHAPES and weight format
of weight_formats.FORMATS (bf16 activations, the shape's top-k), in one process so
kernels compiled for one shape serve the next, and writes one config file per
shape and format into ``--out``; a format the shape's widths cannot hold is skipped.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_experts import SHAPES, TOKENS
from weight_formats import FORMATS, why_not

from torch_moe_ops.backends.triton.tune import tune


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--formats", default="bf16", help=f"of {', '.join(FORMATS)}")
    args = parser.parse_args()
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for fmt in args.formats.split(","):
            reason = why_not(fmt, shape.hidden, shape.inter)
            if reason is not None:
                print(f"== {name} {fmt}: skipped, {reason}", flush=True)
                continue
            start = time.perf_counter()
            print(f"== {name} {fmt}", flush=True)
            tune(shape.num_experts, shape.inter, shape.hidden, shape.top_k, torch.bfloat16,
                 [int(t) for t in args.tokens.split(",")], args.out, FORMATS[fmt])
            print(f"== {name} {fmt}: {time.perf_counter() - start:.0f} s", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
