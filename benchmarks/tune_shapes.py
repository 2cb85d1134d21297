"""Tune the Triton experts configs for the benchmark's model shapes on this GPU.

    python benchmarks/tune_shapes.py --out DIR [--shapes qwen3-30b-a3b,olmoe] [--tokens 1,16]

Runs `torch_moe_ops.tune` once per shape of bench_experts.SHAPES (bf16, the
shape's top-k), in one process so kernels compiled for one shape serve the
next, and writes one config file per shape into ``--out``.
"""

from __future__ import annotations

import argparse
import time

import torch
from bench_experts import SHAPES, TOKENS

from torch_moe_ops.backends.triton.tune import tune


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = parser.parse_args()
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        tune(shape.num_experts, shape.inter, shape.hidden, shape.top_k, torch.bfloat16,
             [int(t) for t in args.tokens.split(",")], args.out)
        print(f"== {name}: {time.perf_counter() - start:.0f} s", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
