"""DeepGEMM's two fp8 grouped GEMMs alone, on rows already in its contiguous layout: the
anchor beside the ``deepgemm`` and ``triton`` rows of bench_experts.py (what DeepGEMM itself
does for a layer, without the routing sort, the quantization of the activations, the
activation between the GEMMs or the weighted sum).

    python benchmarks/deepgemm_gemms.py [--shapes deepseek-v3,mixtral-8x7b] [--tokens 4096]
    python benchmarks/deepgemm_gemms.py --compile-only ...   # DeepGEMM's JIT builds, untimed

Legend: T tokens, K experts per token, E experts, H hidden size, I expert intermediate size,
M rows of the contiguous layout.

Per shape and T: tokens routed as bench_experts.py routes them (same seed), rows laid out by
`deepgemm.experts.contiguous_layout`, activations quantized to fp8 per 1 x 128 group before
the clock starts; timed: ``[M, H] x w13`` then ``[M, I] x w2`` (the second GEMM's input is
quantized before, too), captured in one CUDA graph, the median of cold runs (L2 flushed), as
bench_experts.py times. Prints one row per (shape, T): the time, the FLOPs of the routed rows
over it, and the fraction of the fp8 floor (the dense fp8 rate bench_experts.py measures).
"""

from __future__ import annotations

import argparse

# bench_experts is a sibling of this script, whose folder is on sys.path when it runs.
import bench_experts
import torch

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.sorting import sort_rows
from torch_moe_ops.backends.deepgemm import experts as deepgemm_experts
from torch_moe_ops.backends.deepgemm import library


def gemms_seconds(shape: bench_experts.Shape, num_tokens: int, flush: torch.Tensor | None
                  ) -> float:
    """Seconds of the two GEMMs; with no ``flush`` buffer, runs them once (DeepGEMM compiles
    each kernel on its first call: several processes compile in parallel, each its shapes)
    and returns 0."""
    generator = torch.Generator(device="cuda").manual_seed(num_tokens)
    w13, w2, *_ = bench_experts.make_weights(shape, generator)
    (w13_q, w13_s), (w2_q, w2_s) = (quant.quantize_weights(w, library.FP8_BLOCKS)
                                    for w in (w13, w2))
    hidden_TH, _, topk_ids_TK, *_ = bench_experts.make_problem(shape, num_tokens, (w13, w2),
                                                               generator)
    order_R, sorted_ids_R, count_E = sort_rows(topk_ids_TK, shape.num_experts)
    position_R, expert_M = deepgemm_experts.contiguous_layout(sorted_ids_R, count_E,
                                                              library.row_alignment())
    x_MH = hidden_TH.new_zeros((expert_M.shape[0], shape.hidden))
    x_MH[position_R] = hidden_TH[order_R // shape.top_k]
    q_MH, s_MG = deepgemm_experts.quantize_groups(x_MH)
    a_MI = torch.randn((expert_M.shape[0], shape.inter), device="cuda", dtype=torch.bfloat16)
    p_MI, t_MG = deepgemm_experts.quantize_groups(a_MI)

    def both():
        library.grouped_gemm_contiguous(q_MH, s_MG, w13_q, w13_s, expert_M)
        return library.grouped_gemm_contiguous(p_MI, t_MG, w2_q, w2_s, expert_M)

    if flush is None:
        both()
        torch.cuda.synchronize()
        return 0.0
    replay, _ = bench_experts.graph_timer(both)
    return bench_experts.cold_median_seconds(replay, flush)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="deepseek-v3,mixtral-8x7b,qwen3-30b-a3b,olmoe")
    parser.add_argument("--tokens", default="1,16,4096,16384")
    parser.add_argument("--compile-only", action="store_true",
                        help="run each GEMM once, untimed: DeepGEMM's JIT builds only")
    args = parser.parse_args(argv)
    if args.compile_only:
        for name in args.shapes.split(","):
            for num_tokens in map(int, args.tokens.split(",")):
                gemms_seconds(bench_experts.SHAPES[name], num_tokens, None)
        return
    ceilings = bench_experts.measure_ceilings()
    fp8_rate = ceilings.flops_per_s(library.FP8_BLOCKS)
    flush = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    print(f"{'shape':<16}{'T':>7}{'DeepGEMM us':>13}{'TFLOP/s':>9}{'%fp8':>6}")
    for name in args.shapes.split(","):
        shape = bench_experts.SHAPES[name]
        for num_tokens in map(int, args.tokens.split(",")):
            seconds = gemms_seconds(shape, num_tokens, flush)
            flops = 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.inter
            print(f"{name:<16}{num_tokens:>7}{seconds * 1e6:>13.1f}{flops / seconds / 1e12:>9.0f}"
                  f"{flops / seconds / fp8_rate:>6.0%}", flush=True)


if __name__ == "__main__":
    main()
