"""Where one MoE layer's training step spends its GPU time, way by way.

    python benchmarks/profile_train_step.py [--shape olmoe] [--tokens 8192] [--out FILE]
    python benchmarks/profile_train_step.py --smoke     # CPU, tiny: checks the script

The ways are `bench_train`'s (built by its `build_block`, stepped by its
`training_step`); ``tmo-compiled:NAME`` compiles with ``experts=NAME`` in place
of the automatic choice. Per way:

- ms per step, forward and backward apart (CUDA events around each half of
  back-to-back steps, no profiler running);
- from a ``torch.profiler`` trace of ``--steps`` steps: the GPU-busy time per
  step (the union of kernel, copy and set intervals) against the span from the
  first to the last of them, so the gap between the two is time the GPU sat
  idle (launches, host work, syncs); kernels per step; the time per kernel
  family (library GEMMs, our Triton kernels, Inductor's, ATen's, sort, copies);
  and the top kernels by total time.

A table of the families, one column per way, comes last. On ``--smoke`` the
CPU ops stand in for kernels (nested ones counted in each of their parents).
"""

from __future__ import annotations

import argparse
import statistics
import time

import bench_train
import torch
from kernel_profile import device_trace_events, per_step, trace_events


def split_times(bench: bench_train.Bench, block, x, g, steps: int) -> tuple[float, float]:
    """Median forward and backward ms over ``steps`` back-to-back training steps."""
    marks = []

    def mark():
        if bench.smoke:
            marks.append(time.perf_counter() * 1e3)
        else:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            marks.append(event)

    def elapsed(a, b):
        return b - a if bench.smoke else a.elapsed_time(b)

    step = bench_train.training_step(block, x, g, after_forward=mark)
    bench.sync()
    for _ in range(steps):
        mark()
        step()
        mark()
    bench.sync()
    forward = statistics.median(elapsed(marks[i], marks[i + 1])
                                for i in range(0, len(marks), 3))
    backward = statistics.median(elapsed(marks[i + 1], marks[i + 2])
                                 for i in range(0, len(marks), 3))
    return forward, backward


def profile_way(bench: bench_train.Bench, shape, sizes: dict, way: str, args) -> dict:
    name, _, experts = way.partition(":")
    block = bench_train.build_block(shape, name, bench, experts=experts or "auto")
    x, g = bench_train.inputs(sizes, args.tokens, bench)
    step = bench_train.training_step(block, x, g)
    for _ in range(3):
        step()
    forward_ms, backward_ms = split_times(bench, block, x, g, args.timed_steps)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not bench.smoke:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.steps):
            step()
        bench.sync()
    events = device_trace_events(trace_events(prof), bench.smoke)
    starts, ends = ([e["ts"] for e in events], [e["ts"] + e["dur"] for e in events])
    result = {"way": way, "forward_ms": forward_ms, "backward_ms": backward_ms,
              "span_ms": (max(ends) - min(starts)) / 1e3 / args.steps,
              **per_step(events, args.steps)}
    del block, step, prof
    bench.release()
    return result


def report(results: list[dict], args) -> str:
    lines = [f"# Training step profile: {args.shape}, T={args.tokens}, {args.steps} steps", ""]
    for r in results:
        idle = r["span_ms"] - r["busy_ms"]
        summary = (f"step {r['forward_ms'] + r['backward_ms']:.3f} ms (forward "
                   f"{r['forward_ms']:.3f}, backward {r['backward_ms']:.3f}); GPU busy "
                   f"{r['busy_ms']:.3f} ms of a {r['span_ms']:.3f} ms span per step (idle "
                   f"{idle:.3f} ms); {r['kernels']:.0f} kernels per step")
        lines += [f"## {r['way']}", summary, f"{'ms/step':>8} {'calls':>6}  kernel"]
        lines += [f"{ms:8.3f} {calls:6.1f}  {kernel[:110]}" for ms, calls, kernel
                  in r["top"][:args.top]]
        lines.append("")
    names = sorted({f for r in results for f in r["families"]})
    lines.append("| ms per step | " + " | ".join(r["way"] for r in results) + " |")
    lines.append("|---" * (len(results) + 1) + "|")
    for row in ("forward", "backward"):
        lines.append(f"| {row} (events) | "
                     + " | ".join(f"{r[row + '_ms']:.3f}" for r in results) + " |")
    for f in names:
        lines.append(f"| {f} | " + " | ".join(f"{r['families'].get(f, 0.0):.3f}"
                                             for r in results) + " |")
    lines.append("| GPU busy | " + " | ".join(f"{r['busy_ms']:.3f}" for r in results) + " |")
    lines.append("| span | " + " | ".join(f"{r['span_ms']:.3f}" for r in results) + " |")
    return "\n".join(lines)


def profile_ways(ways: list[str], profile_one, report_of, out: str | None) -> str:
    """``profile_one(way)`` for each way in turn and the report of those done so far,
    ``report_of(results)``, written to ``out`` after every way (so that a way that fails
    leaves the others' report); returns the last report."""
    results = []
    for way in ways:
        results.append(profile_one(way))
        text = report_of(results)
        if out:
            with open(out, "w") as f:
                f.write(text + "\n")
    return text


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="olmoe", help=", ".join(bench_train.SHAPES))
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--ways", default="tmo,tmo-compiled,hf-compiled,tmo-compiled:grouped_mm",
                        help="bench_train ways; tmo-compiled:NAME names the experts backend")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps per way")
    parser.add_argument("--timed-steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shape on the CPU, fp32")
    args = parser.parse_args(argv)
    bench = bench_train.Bench(args)
    if args.smoke:
        shape, args.shape, args.tokens = bench_train.SMOKE_SHAPE, "smoke", 64
        args.ways = "tmo,tmo-compiled"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("profile_train_step.py needs a CUDA GPU; --smoke runs on the CPU")
        shape = bench_train.SHAPES[args.shape]
    sizes = bench_train.moe_sizes(shape.config(1))
    def profile_one(way: str) -> dict:
        result = profile_way(bench, shape, sizes, way, args)
        print(f"{way}: {result['forward_ms'] + result['backward_ms']:.3f} ms/step", flush=True)
        return result

    print(profile_ways(args.ways.split(","), profile_one, lambda r: report(r, args), args.out))


if __name__ == "__main__":
    main()
