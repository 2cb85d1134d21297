"""The host time of one uncompiled MoE block call, patched against transformers, and of its parts.

    python benchmarks/bench_eager_block.py [--shapes qwen3-30b-a3b,olmoe] [--tokens 512,2048]
    python benchmarks/bench_eager_block.py --smoke     # CPU, tiny: checks the script
    python benchmarks/bench_eager_block.py --profile DIR   # and where the patched block's
                                                         # host time goes, per model and T

An uncompiled forward (``generate``'s prefill with a static cache) is host-bound at
a few hundred tokens: each op's Python and launch cost adds up, layer after layer.
For each model (bench_model's shapes, one layer, random weights) and token count,
the sparse-MoE block of both ways is called back to back ``--calls`` times, and so
are the parts of the patched block: its router (``moe::route`` inside), the
``moe::experts`` op, the same op through ``ops.library.call`` (its kernel directly, as the
block calls it), the ``triton`` backend's function under it, and its align step.
Per call: the host time (from the first call's start to the last call's return,
the GPU still running) and the wall time (to the GPU's end); where the host time is
close to the wall time, the host is the bottleneck.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time
from pathlib import Path

import bench_generate
import bench_model
import torch

from torch_moe_ops.ops.library import call
from torch_moe_ops.routed_experts import run_experts


def host_and_wall_us(fn, calls: int, sync) -> tuple[float, float]:
    for _ in range(5):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    returned = time.perf_counter()
    sync()
    end = time.perf_counter()
    return (returned - start) / calls * 1e6, (end - start) / calls * 1e6


def host_profile(fn, calls: int, sync) -> str:
    """Python's profile of ``calls`` calls of ``fn`` (after a warm-up): the functions that
    take the most time themselves, then those whose calls take the most in all."""
    for _ in range(5):
        fn()
    sync()
    profiler = cProfile.Profile()
    profiler.runcall(lambda: [fn() for _ in range(calls)])
    text = io.StringIO()
    # Bare file names: the results keep no path of the machine that ran them.
    stats = pstats.Stats(profiler, stream=text).strip_dirs()
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    return text.getvalue()


def parts(shape, tokens: int, args) -> list[tuple[str, object]]:
    """(name, zero-argument call) of both blocks and the patched block's parts."""
    blocks = {way: bench_model.moe_blocks(bench_model.build(
        shape, way, 1, device=args.device, dtype=args.dtype))[0]
        for way in ("hf-grouped_mm", "tmo-patch")}
    hf, ours = blocks["hf-grouped_mm"], blocks["tmo-patch"]
    hidden = ours.cfg.hidden_size
    x_BSH = torch.randn(1, tokens, hidden, device=args.device, dtype=args.dtype)
    x_TH = x_BSH.view(-1, hidden)
    router = getattr(ours, ours.router_name)
    _, weights_TK, ids_TK = router(x_TH)
    cfg = ours.cfg
    experts_args = (x_TH, weights_TK, ids_TK, *ours.expert_weights(), cfg.activation,
                    cfg.static_float("swiglu_alpha"), cfg.static_float("swiglu_limit"))
    calls = [("transformers block", lambda: hf(x_BSH)),
             ("patched block", lambda: ours(x_BSH)),
             ("  its router", lambda: router(x_TH)),
             ("  run_experts", lambda: run_experts(cfg, "", x_TH, weights_TK, ids_TK,
                                                   ours.expert_weights(),
                                                   ours.expert_scales())),
             ("  moe::experts", lambda: torch.ops.moe.experts(*experts_args)),
             ("  call(moe::experts)", lambda: call(torch.ops.moe.experts, *experts_args))]
    if args.device == "cuda":
        from torch_moe_ops.backends.common.kernels import align
        from torch_moe_ops.backends.triton import fused

        config = fused._plan(x_TH, ids_TK, experts_args[3])
        calls += [(f"  triton fused_experts ({config.path})",
                   lambda: fused.fused_experts(*experts_args))]
        if config.path == "tiled":
            calls += [("    its align_rows", lambda: align.align_rows(
                ids_TK, cfg.num_experts, config.BLOCK_M))]
    return calls


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b,olmoe",
                        help=", ".join(bench_generate.MODELS))
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=5,
                        help="each part timed this many times, in turn; the median is shown")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, fp32")
    parser.add_argument("--profile", default=None, metavar="DIR",
                        help="write the patched block's Python profile per model and T here")
    args = parser.parse_args(argv)
    if args.smoke:
        shapes, args.device, args.dtype = bench_generate.SMOKE_SHAPES, "cpu", torch.float32
        args.tokens, args.calls, args.rounds = "8", 3, 2
        sync, device = (lambda: None), "CPU"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_eager_block.py needs a CUDA GPU; --smoke runs on the CPU")
        shapes, args.device, args.dtype = bench_model.SHAPES, "cuda", torch.bfloat16
        sync, device = torch.cuda.synchronize, torch.cuda.get_device_name()
    lines = [(f"{device}, {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, one layer, "
             f"{args.calls} calls, median of {args.rounds} rounds"), "",
             "| model | T | call | host us | wall us |", "|---|---|---|---|---|"]
    torch.set_grad_enabled(False)
    for name in args.shapes.split(","):
        for tokens in (int(t) for t in args.tokens.split(",")):
            timed = parts(shapes[name], tokens, args)
            # Rounds over every part in turn, the median of each: the host's other work
            # (the machine is shared) moves single runs by 10-40%.
            rounds = [[host_and_wall_us(fn, args.calls, sync) for _, fn in timed]
                      for _ in range(args.rounds)]
            for index, (label, fn) in enumerate(timed):
                host, wall = (statistics.median(times[index][which] for times in rounds)
                              for which in (0, 1))
                lines.append(f"| {name} | {tokens} | {label} | {host:.1f} | {wall:.1f} |")
                if args.profile and label == "patched block":
                    folder = Path(args.profile)
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / f"profile-{name}-{tokens}.txt").write_text(
                        host_profile(fn, args.calls, sync))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
