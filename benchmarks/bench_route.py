"""Time DeepSeek-V3 routing on FlashInfer's fused kernel (the ``flashinfer`` route
backend) against ours (the reference routing, compiled by Inductor as a compiled
model runs it, and eager).

    python benchmarks/bench_route.py [--tokens 1,16,128,1024,4096,16384] [--out DIR]
    python benchmarks/bench_route.py --smoke [--out DIR]   # CPU, T in 1, 16: checks the script

Legend: T tokens, E experts, K experts per token.

The routing of DeepSeek-V3: fp32 logits ``[T, 256]`` (what the MoE layer's router
hands ``moe::route``), an fp32 correction bias, sigmoid scores, 8 groups of 32
experts of which 4 are kept, top-8, renormalized, scaled by 2.5. Rows:

- ``flashinfer``: ``moe_flashinfer_route::route``, the backend's op (FlashInfer's
  kernel and the allocation of its outputs);
- ``flashinfer kernel``: ``fused_topk_deepseek`` alone on outputs allocated once,
  the floor of that op;
- ``reference compiled``: ``moe::route`` under ``torch.compile(fullgraph=True,
  backend=tmo.backend(route="reference"))``: Inductor's fused kernels;
- ``reference eager``: ``moe_reference::route``, its torch ops one by one.

Each row is captured in one CUDA graph that calls it ``--repeat`` times back to
back; the time is ``triton.testing.do_bench``'s median of the graph's replay over
that count. (``do_bench`` writes 256 MB to flush L2 before each replay, and the
write-back of that dirty L2 lands in the timed replay: microseconds, on calls of
a few. Repeated calls spread it out, and find the logits in L2, as routing does
right after the router's GEMM wrote them.) ``same_sets``: the fraction of tokens
whose expert set equals the reference's (eager); ties are all but impossible on
random fp32 logits.

Prints every row, then a short table and the target (the kernel faster than
ours, compiled and eager, at every T) last; ``--out`` also writes ``route.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

import torch
from bench_experts import graph_timer

import torch_moe_ops as tmo
from torch_moe_ops.backends.flashinfer import route as fi_route
from torch_moe_ops.backends.flashinfer.library import missing
from torch_moe_ops.backends.registry import REGISTRY, Problem

NUM_EXPERTS, TOP_K, GROUPS, TOPK_GROUPS, SCALE = 256, 8, 8, 4, 2.5
TOKENS = (1, 16, 128, 1024, 4096, 16384)
SMOKE_TOKENS = (1, 16)
BACKENDS = ("flashinfer", "flashinfer kernel", "reference compiled", "reference eager")
OURS = ("reference compiled", "reference eager")


def route_generic(logits_TE: torch.Tensor, bias_E: torch.Tensor):
    return torch.ops.moe.route(logits_TE, bias_E, TOP_K, "sigmoid", True, GROUPS, TOPK_GROUPS,
                               SCALE)


def route_backend_op(namespace: str) -> Callable:
    op = getattr(torch.ops, namespace).route
    return lambda logits_TE, bias_E: op(logits_TE, bias_E, TOP_K, "sigmoid", True, GROUPS,
                                        TOPK_GROUPS, SCALE)


def kernel_alone(num_tokens: int, device: torch.device) -> Callable:
    """FlashInfer's kernel on outputs allocated once (skip_check: as the backend calls it)."""
    from flashinfer.fused_moe import fused_topk_deepseek

    weights_TK = torch.empty(num_tokens, TOP_K, device=device)
    ids_TK = torch.empty(num_tokens, TOP_K, device=device, dtype=torch.int32)

    def run(logits_TE, bias_E):
        fused_topk_deepseek(logits_TE, bias_E, GROUPS, TOPK_GROUPS, TOP_K, SCALE, weights_TK,
                            ids_TK, skip_check=True)
        return weights_TK, ids_TK

    return run


def compiled_reference(smoke: bool) -> Callable:
    torch._dynamo.reset()
    # The smoke run checks the script, not Inductor: it skips Inductor's CPU build.
    backend = tmo.backend(route="reference", inner="aot_eager" if smoke else "inductor")
    return torch.compile(route_generic, backend=backend, fullgraph=True, dynamic=False)


def why_not(backend: str, device: torch.device) -> str | None:
    """Why ``backend`` (a row) cannot run here, or None."""
    if backend.startswith("flashinfer"):
        problem = Problem(torch.float32, num_experts=NUM_EXPERTS, top_k=TOP_K,
                          scoring="sigmoid", renormalize=True, num_expert_groups=GROUPS,
                          topk_groups=TOPK_GROUPS, correction_bias=True)
        return REGISTRY.route["flashinfer"].supports(None, problem, device)
    return None


def make_fn(backend: str, num_tokens: int, device: torch.device, smoke: bool) -> Callable:
    if backend == "flashinfer":
        return route_backend_op(fi_route.NAMESPACE)
    if backend == "flashinfer kernel":
        return kernel_alone(num_tokens, device)
    if backend == "reference compiled":
        return compiled_reference(smoke)
    return route_backend_op("moe_reference")


def seconds_per_call(fn: Callable[[], object], device: torch.device, repeat: int
                     ) -> tuple[float, object]:
    """Median seconds of one call and its output: CUDA-graph replays on a GPU, plain
    timed calls on the CPU."""
    if device.type == "cuda":
        import triton.testing

        replay, out = graph_timer(fn, repeat)
        replay()
        torch.cuda.synchronize()
        return triton.testing.do_bench(replay, return_mode="median") * 1e-3 / repeat, out
    out = fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def same_sets(ids_TK: torch.Tensor, ref_ids_TK: torch.Tensor) -> float:
    """The fraction of tokens whose expert set is the reference's."""
    equal_T = (ids_TK.sort(-1).values == ref_ids_TK.sort(-1).values).all(-1)
    return equal_T.float().mean().item()


def run_tokens(num_tokens: int, device: torch.device, args, skipped: dict) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    logits_TE = torch.randn(num_tokens, NUM_EXPERTS, device=device, generator=generator)
    bias_E = torch.rand(NUM_EXPERTS, device=device, generator=generator) * 0.1
    _, ref_ids_TK = torch.ops.moe_reference.route(logits_TE, bias_E, TOP_K, "sigmoid", True,
                                                  GROUPS, TOPK_GROUPS, SCALE)
    rows = []
    for backend in BACKENDS:
        reason = why_not(backend, device)
        if reason is not None:
            skipped[backend] = reason
            continue
        fn = make_fn(backend, num_tokens, device, args.smoke)
        seconds, (_, ids_TK) = seconds_per_call(lambda fn=fn: fn(logits_TE, bias_E), device,
                                                args.repeat)
        row = {"T": num_tokens, "backend": backend, "us": seconds * 1e6,
               "same_sets": same_sets(ids_TK, ref_ids_TK)}
        print(f"T={num_tokens:>6}  {backend:<20} {row['us']:9.2f} us  "
              f"same sets {row['same_sets']:.4f}", flush=True)
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> list[str]:
    """The short table (us per call, the kernel's speedup over ours) and the target."""
    by_t = {}
    for row in rows:
        by_t.setdefault(row["T"], {})[row["backend"]] = row["us"]
    header = (f"{'T':>6}  " + "  ".join(f"{b:>18}" for b in BACKENDS)
              + f"  {'x vs compiled':>13}  {'x vs eager':>10}")
    lines = [header]
    missed = []
    for num_tokens, cells in sorted(by_t.items()):
        line = f"{num_tokens:>6}  " + "  ".join(
            f"{cells[b]:>18.2f}" if b in cells else f"{'-':>18}" for b in BACKENDS)
        ratios = []
        for ours in OURS:
            if "flashinfer" in cells and ours in cells:
                ratios.append(f"{cells[ours] / cells['flashinfer']:.2f}x")
                if cells["flashinfer"] >= cells[ours]:
                    missed.append(f"T={num_tokens} ({ours})")
            else:
                ratios.append("-")
        lines.append(line + f"  {ratios[0]:>13}  {ratios[1]:>10}")
    if not any("flashinfer" in cells for cells in by_t.values()):
        verdict = "not measured (the flashinfer rows did not run)"
    else:
        verdict = "met" if not missed else "missed at " + ", ".join(missed)
    lines.append("target: the flashinfer route faster than ours (compiled and eager) at every "
                 f"T: {verdict}")
    return lines


def flashinfer_version() -> str:
    reason = missing()
    if reason is not None:
        return reason
    import flashinfer

    return flashinfer.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default=None,
                        help="comma-separated token counts (default " +
                             ",".join(map(str, TOKENS)) + ")")
    parser.add_argument("--repeat", type=int, default=20,
                        help="calls per captured CUDA graph (default 20)")
    parser.add_argument("--out", default=None, help="folder for route.json")
    parser.add_argument("--smoke", action="store_true",
                        help="on the CPU, T in 1, 16: checks the script")
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    tokens = (tuple(int(t) for t in args.tokens.split(",")) if args.tokens
              else SMOKE_TOKENS if args.smoke else TOKENS)
    name = "cpu" if args.smoke else torch.cuda.get_device_name(device)
    print(f"DeepSeek-V3 routing (E={NUM_EXPERTS}, {GROUPS} groups, {TOPK_GROUPS} kept, "
          f"top-{TOP_K}, fp32 logits) on {name}; torch {torch.__version__}, flashinfer "
          f"{flashinfer_version()}", flush=True)
    rows, skipped = [], {}
    for num_tokens in tokens:
        rows += run_tokens(num_tokens, device, args, skipped)
    for backend, reason in skipped.items():
        print(f"skipped {backend}: {reason}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        header = {"device": name, "torch": torch.__version__, "python": platform.python_version(),
                  "flashinfer": flashinfer_version(),
                  "date": datetime.date.today().isoformat(), "repeat": args.repeat,
                  "routing": {"num_experts": NUM_EXPERTS, "top_k": TOP_K, "groups": GROUPS,
                              "topk_groups": TOPK_GROUPS, "scale": SCALE},
                  "skipped": skipped}
        with open(os.path.join(args.out, "route.json"), "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    print("\n".join(summary(rows)))


if __name__ == "__main__":
    main()
