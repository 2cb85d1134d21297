"""Where the time of an experts call goes, kernel by kernel.

    python benchmarks/decode_breakdown.py [--shapes qwen3-30b-a3b,olmoe] [--tokens 1,4]
        [--formats bf16,mxfp4] [--backend deepgemm]

For each shape and token count, the backend's call (`triton` unless told) is captured in a
CUDA graph and timed three ways: with ``do_bench`` (whose L2 flush writes 256 MB, so the
call starts with that much dirty L2 to write back), as bench_experts.py does
(after a flush that only reads: clean L2, as after other layers' kernels), and
per kernel from a profile of the replays. Each is set against the
row's floor (bench_experts' ceilings, measured in the same run).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import triton.testing
from bench_experts import (
    SHAPES,
    cold_median_seconds,
    floor_seconds,
    graph_timer,
    make_problem,
    make_weights,
    measure_ceilings,
)
from weight_formats import FORMATS, expert_weights, why_not

from torch_moe_ops.backends.registry import REGISTRY

REPLAYS = 50


def _device_us(fn, repeats: int) -> dict[str, float]:
    """Device microseconds per repeat of each kernel ``fn`` runs, by kernel name."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    totals = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] += event.device_time / repeats
    return dict(totals)


def kernel_us(replay, flush_buffer: torch.Tensor) -> dict[str, float]:
    """Mean device time per replay of each kernel the graph runs, cold: the
    kernels of the flush between replays are left out by name."""
    flush_kernels = set(_device_us(flush_buffer.sum, 1))

    def flushed_replay():
        flush_buffer.sum()
        replay()

    return {name: us for name, us in _device_us(flushed_replay, REPLAYS).items()
            if name not in flush_kernels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default="1,4,16")
    parser.add_argument("--formats", default="bf16", help=f"of {', '.join(FORMATS)}")
    parser.add_argument("--backend", default="triton", choices=sorted(REGISTRY.experts),
                        help="whose experts op to break down")
    args = parser.parse_args()
    namespace = REGISTRY.experts[args.backend].namespace
    ceilings = measure_ceilings()
    flush_buffer = torch.empty(2**28, device="cuda", dtype=torch.float32)
    generator = torch.Generator(device="cuda").manual_seed(0)
    lines = []
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        float_weights = make_weights(shape, generator)
        for fmt in args.formats.split(","):
            if why_not(fmt, shape.hidden, shape.inter) is not None:
                continue
            weights = expert_weights(fmt, *float_weights)
            op = weights.op(namespace)
            for num_tokens in map(int, args.tokens.split(",")):
                routing = make_problem(shape, num_tokens, float_weights, generator)[:3]
                problem = (*routing, *weights.op_args())
                floor_s = floor_seconds(shape, num_tokens, problem[2], ceilings, weights)[0]
                static = (shape.activation, 1.702, 7.0)
                replay, _ = graph_timer(
                    lambda problem=problem, static=static, op=op: op(*problem, *static))
                write_flushed = triton.testing.do_bench(replay, return_mode="median") * 1e3
                read_flushed = cold_median_seconds(replay, flush_buffer) * 1e6
                kernels = kernel_us(replay, flush_buffer)
                parts = ", ".join(f"{k[:28]} {v:.1f}" for k, v in kernels.items())
                lines.append(
                    f"{name:14} {fmt:11} T={num_tokens:<5} floor {floor_s * 1e6:7.1f} us | "
                    f"do_bench {write_flushed:7.1f} ({floor_s * 1e6 / write_flushed:4.0%}) | "
                    f"read-flushed {read_flushed:7.1f} ({floor_s * 1e6 / read_flushed:4.0%})"
                    f" | kernels: {parts}")
            del weights
        del float_weights
        torch.cuda.empty_cache()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
