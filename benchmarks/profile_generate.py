"""Where the time of `bench_generate`'s rows goes: prefill on the host, decode steps on the GPU.

    python benchmarks/profile_generate.py [--shape qwen3-30b-a3b] [--layers 8] [--prompt 512]
    python benchmarks/profile_generate.py --smoke     # CPU, tiny: checks the script

For each way of `bench_generate` (the model built, compiled and warmed up as it
does, batch 1):

- prefill (``generate`` of one new token, uncompiled as `bench_generate` runs it):
  the wall time, the GPU-busy time in it, the ops with the most host time (self
  CPU per call of the prefill) and the Python functions with the most time of
  their own (``cProfile``): what an eager forward spends launching;
- decode (``generate`` of ``--new-tokens`` tokens, the steps after the first
  token): per step the wall time, the GPU-busy time (the union of kernel, copy and
  set intervals), kernels, the time per kernel family and the top kernels.

A table of both ways side by side comes last. On ``--smoke`` the CPU ops stand
in for kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import bench_generate
import bench_model
import torch
import transformers
from kernel_profile import busy_us, device_trace_events, per_step, trace_events
from profile_train_step import profile_ways

FIRST_TOKEN_MARK = "first_token_logits"


class MarkFirstToken(transformers.LogitsProcessor):
    """Leaves the scores alone; puts a named host event in the profile when the first
    token's logits exist (after a copy to the host, so the GPU is idle then)."""

    def __init__(self):
        self.done = False

    def __call__(self, input_ids, scores):
        if not self.done:
            self.done = True
            scores.float().cpu()
            with torch.profiler.record_function(FIRST_TOKEN_MARK):
                pass
        return scores


def prefill_profile(model, ids_BS, compiled, args) -> dict:
    """One ``generate`` of a single token: the prefill and what follows it once."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not args.smoke:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        begin = time.perf_counter()
        bench_generate.greedy_generate(model, ids_BS, 1, compiled)
        args.sync()
        wall_ms = (time.perf_counter() - begin) * 1e3
    events = device_trace_events(trace_events(prof), args.smoke)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:args.top]
    python = cProfile.Profile()
    python.enable()
    bench_generate.greedy_generate(model, ids_BS, 1, compiled)
    args.sync()
    python.disable()
    text = io.StringIO()
    pstats.Stats(python, stream=text).strip_dirs().sort_stats("tottime").print_stats(args.top)
    return {"wall_ms": wall_ms,
            "busy_ms": busy_us([(e["ts"], e["ts"] + e["dur"]) for e in events]) / 1e3,
            "kernels": len(events),
            "top_ops": [(e.key, e.self_cpu_time_total / 1e3, e.count) for e in top],
            "python": text.getvalue()}


def decode_profile(model, ids_BS, compiled, args) -> dict:
    """One ``generate`` of ``--new-tokens`` tokens: the steps after the first token."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if not args.smoke:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        bench_generate.greedy_generate(model, ids_BS, args.new_tokens, compiled, [MarkFirstToken()])
        args.sync()
    events = trace_events(prof)
    mark = next(e["ts"] + e.get("dur", 0) for e in events if e.get("name") == FIRST_TOKEN_MARK)
    decode = [e for e in device_trace_events(events, args.smoke) if e["ts"] >= mark]
    host_end = max(e["ts"] + e.get("dur", 0) for e in events if e.get("cat") == "cpu_op")
    steps = args.new_tokens - 1
    end = max([host_end] + [e["ts"] + e["dur"] for e in decode])
    return {"step_ms": (end - mark) / 1e3 / steps, **per_step(decode, steps)}


def profile_way(shape, way: str, args) -> dict:
    model = bench_model.build(shape, way, args.layers, device=args.device, dtype=args.dtype)
    torch._dynamo.reset()
    compiled = bench_generate.compile_config(way, args)
    ids_BS = bench_generate.prompts(model.config, 1, args.prompt, torch.device(args.device))
    for _ in range(2):  # compiles, then records the decode graph
        bench_generate.greedy_generate(model, ids_BS, args.new_tokens, compiled)
    args.sync()
    result = {"way": way, "prefill": prefill_profile(model, ids_BS, compiled, args),
              "decode": decode_profile(model, ids_BS, compiled, args)}
    del model
    torch._dynamo.reset()
    return result


def report(results: list[dict], args) -> str:
    lines = [(f"# generate() profile: {args.shape}, {args.layers} layers, B=1, S={args.prompt}, "
             f"{args.new_tokens} new tokens ({args.meta})"), ""]
    for r in results:
        p, d = r["prefill"], r["decode"]
        lines += [f"## {r['way']}: prefill",
                  (f"wall {p['wall_ms']:.2f} ms (profiled), GPU busy {p['busy_ms']:.2f} ms, "
                  f"{p['kernels']} kernels"), f"{'self ms':>8} {'calls':>6}  host op"]
        lines += [f"{ms:8.3f} {calls:6d}  {key[:100]}" for key, ms, calls in p["top_ops"]]
        lines += ["", "Python, by own time:", "```", p["python"].strip(), "```", "",
                  f"## {r['way']}: decode",
                  (f"step {d['step_ms']:.3f} ms, GPU busy {d['busy_ms']:.3f} ms, "
                  f"{d['kernels']:.0f} kernels per step"), f"{'ms/step':>8} {'calls':>6}  kernel"]
        lines += [f"{ms:8.4f} {calls:6.1f}  {kernel[:100]}" for ms, calls, kernel
                  in d["top"][:args.top]]
        lines.append("")
    lines.append("| per call | " + " | ".join(r["way"] for r in results) + " |")
    lines.append("|---" * (len(results) + 1) + "|")
    rows = [("prefill wall ms", lambda r: r["prefill"]["wall_ms"]),
            ("prefill GPU busy ms", lambda r: r["prefill"]["busy_ms"]),
            ("prefill kernels", lambda r: r["prefill"]["kernels"]),
            ("decode step ms", lambda r: r["decode"]["step_ms"]),
            ("decode GPU busy ms", lambda r: r["decode"]["busy_ms"]),
            ("decode kernels", lambda r: r["decode"]["kernels"])]
    families = sorted({f for r in results for f in r["decode"]["families"]})
    rows += [(f"decode {f} ms", lambda r, f=f: r["decode"]["families"].get(f, 0.0))
             for f in families]
    for label, value in rows:
        lines.append(f"| {label} | " + " | ".join(f"{value(r):.3f}" for r in results) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="qwen3-30b-a3b",
                        help=", ".join(bench_generate.MODELS))
    parser.add_argument("--ways", default=",".join(bench_generate.WAYS))
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU, fp32")
    args = parser.parse_args(argv)
    args.inner = "aot_eager" if args.smoke else "inductor"
    args.mode = None if args.smoke else "reduce-overhead"
    if args.smoke:
        args.device, args.dtype, args.prompt, args.new_tokens = "cpu", torch.float32, 12, 4
        shape = bench_generate.SMOKE_SHAPES[args.shape]
        args.sync = lambda: None
        args.meta = "CPU smoke"
    else:
        if not torch.cuda.is_available():
            raise SystemExit("profile_generate.py needs a CUDA GPU; --smoke runs on the CPU")
        args.device, args.dtype = "cuda", torch.bfloat16
        shape = bench_model.SHAPES[args.shape]
        args.sync = torch.cuda.synchronize
        args.meta = (f"{torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%d')}, "
                     f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(profile_ways(args.ways.split(","), lambda way: profile_way(shape, way, args),
                       lambda results: report(results, args), args.out))


if __name__ == "__main__":
    main()
