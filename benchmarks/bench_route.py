"""Time a route kernel against ours: FlashInfer's fused kernel on DeepSeek-V3's routing,
our Triton kernel on Qwen3-30B-A3B's, each against the reference routing (compiled by
Inductor, as a compiled model runs it, and eager).

    python benchmarks/bench_route.py [--routing deepseek-v3|qwen3-30b-a3b]
                                     [--tokens 1,16,128,1024,4096,16384] [--out DIR]
    python benchmarks/bench_route.py --smoke [--out DIR]   # CPU, T in 1, 16: checks the script

Legend: T tokens, E experts, K experts per token.

Routings (``ROUTINGS``): DeepSeek-V3's fp32 logits ``[T, 256]`` (what the MoE layer's
router hands ``moe::route``), an fp32 correction bias, sigmoid scores, 8 groups of 32
experts of which 4 are kept, top-8, renormalized, scaled by 2.5; Qwen3-30B-A3B's bf16
logits ``[T, 128]`` (its router's GEMM runs in the weights' dtype), softmax, top-8,
renormalized. Rows:

- the routing's kernel (``flashinfer``: ``moe_flashinfer_route::route``; ``triton``:
  ``moe_triton_route::route``), the backend's op with the allocation of its outputs;
- ``flashinfer kernel``: ``fused_topk_deepseek`` alone on outputs allocated once,
  the floor of that op (DeepSeek-V3 only);
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
random fp32 logits (bf16 logits tie more often).

Prints every row, then a short table and the target (the kernel faster than
ours, compiled and eager, at every T) last; ``--out`` also writes ``route.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
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


@dataclasses.dataclass(frozen=True)
class Routing:
    """One model's routing (the static arguments of ``moe::route``) and the route
    backend whose kernel is measured against the reference on it."""

    title: str
    num_experts: int
    top_k: int
    scoring: str
    renormalize: bool
    groups: int
    topk_groups: int
    scale: float
    bias: bool
    dtype: torch.dtype
    kernel: str

    def args(self, logits_TE: torch.Tensor, bias_E: torch.Tensor | None) -> tuple:
        return (logits_TE, bias_E, self.top_k, self.scoring, self.renormalize, self.groups,
                self.topk_groups, self.scale)

    @property
    def backends(self) -> tuple[str, ...]:
        floor = ("flashinfer kernel",) if self.kernel == "flashinfer" else ()
        return (self.kernel, *floor, *OURS)


ROUTINGS = {
    "deepseek-v3": Routing("DeepSeek-V3 routing (E=256, 8 groups, 4 kept, top-8, sigmoid + "
                           "bias, fp32 logits)", 256, 8, "sigmoid", True, 8, 4, 2.5, True,
                           torch.float32, "flashinfer"),
    "qwen3-30b-a3b": Routing("Qwen3-30B-A3B routing (E=128, top-8, softmax, renormalized, "
                             "bf16 logits)", 128, 8, "softmax", True, 1, 1, 1.0, False,
                             torch.bfloat16, "triton"),
}
TOKENS = (1, 16, 128, 1024, 4096, 16384)
SMOKE_TOKENS = (1, 16)
OURS = ("reference compiled", "reference eager")
NAMESPACES = {"flashinfer": fi_route.NAMESPACE, "triton": "moe_triton_route",
              "reference eager": "moe_reference"}


def route_backend_op(namespace: str, routing: Routing) -> Callable:
    op = getattr(torch.ops, namespace).route
    return lambda logits_TE, bias_E: op(*routing.args(logits_TE, bias_E))


def kernel_alone(num_tokens: int, device: torch.device, routing: Routing) -> Callable:
    """FlashInfer's kernel on outputs allocated once (skip_check: as the backend calls it)."""
    from flashinfer.fused_moe import fused_topk_deepseek

    weights_TK = torch.empty(num_tokens, routing.top_k, device=device)
    ids_TK = torch.empty(num_tokens, routing.top_k, device=device, dtype=torch.int32)

    def run(logits_TE, bias_E):
        fused_topk_deepseek(logits_TE, bias_E, routing.groups, routing.topk_groups,
                            routing.top_k, routing.scale, weights_TK, ids_TK, skip_check=True)
        return weights_TK, ids_TK

    return run


def compiled_reference(smoke: bool, routing: Routing) -> Callable:
    torch._dynamo.reset()
    # The smoke run checks the script, not Inductor: it skips Inductor's CPU build.
    backend = tmo.backend(route="reference", inner="aot_eager" if smoke else "inductor")
    return torch.compile(lambda logits_TE, bias_E: torch.ops.moe.route(
        *routing.args(logits_TE, bias_E)), backend=backend, fullgraph=True, dynamic=False)


def why_not(backend: str, device: torch.device, routing: Routing) -> str | None:
    """Why ``backend`` (a row) cannot run ``routing`` here, or None."""
    if backend in OURS:
        return None
    problem = Problem(routing.dtype, num_experts=routing.num_experts, top_k=routing.top_k,
                      scoring=routing.scoring, renormalize=routing.renormalize,
                      num_expert_groups=routing.groups, topk_groups=routing.topk_groups,
                      correction_bias=routing.bias)
    name = backend.removesuffix(" kernel")
    return REGISTRY.route[name].supports(tmo.BackendSpec(route=name), problem, device)


def make_fn(backend: str, num_tokens: int, device: torch.device, smoke: bool,
            routing: Routing) -> Callable:
    if backend == "flashinfer kernel":
        return kernel_alone(num_tokens, device, routing)
    if backend == "reference compiled":
        return compiled_reference(smoke, routing)
    return route_backend_op(NAMESPACES[backend], routing)


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


def run_tokens(num_tokens: int, device: torch.device, routing: Routing, args,
               skipped: dict) -> list[dict]:
    generator = torch.Generator(device=device).manual_seed(num_tokens)
    logits_TE = torch.randn(num_tokens, routing.num_experts, device=device,
                            generator=generator).to(routing.dtype)
    bias_E = (torch.rand(routing.num_experts, device=device, generator=generator) * 0.1
              if routing.bias else None)
    _, ref_ids_TK = torch.ops.moe_reference.route(*routing.args(logits_TE, bias_E))
    rows = []
    for backend in routing.backends:
        reason = why_not(backend, device, routing)
        if reason is not None:
            skipped[backend] = reason
            continue
        fn = make_fn(backend, num_tokens, device, args.smoke, routing)
        seconds, (_, ids_TK) = seconds_per_call(lambda fn=fn: fn(logits_TE, bias_E), device,
                                                args.repeat)
        row = {"T": num_tokens, "backend": backend, "us": seconds * 1e6,
               "same_sets": same_sets(ids_TK, ref_ids_TK)}
        print(f"T={num_tokens:>6}  {backend:<20} {row['us']:9.2f} us  "
              f"same sets {row['same_sets']:.4f}", flush=True)
        rows.append(row)
    return rows


def summary(rows: list[dict], routing: Routing) -> list[str]:
    """The short table (us per call, the kernel's speedup over ours) and the target."""
    kernel, backends = routing.kernel, routing.backends
    by_t = {}
    for row in rows:
        by_t.setdefault(row["T"], {})[row["backend"]] = row["us"]
    header = (f"{'T':>6}  " + "  ".join(f"{b:>18}" for b in backends)
              + f"  {'x vs compiled':>13}  {'x vs eager':>10}")
    lines = [header]
    missed = []
    for num_tokens, cells in sorted(by_t.items()):
        line = f"{num_tokens:>6}  " + "  ".join(
            f"{cells[b]:>18.2f}" if b in cells else f"{'-':>18}" for b in backends)
        ratios = []
        for ours in OURS:
            if kernel in cells and ours in cells:
                ratios.append(f"{cells[ours] / cells[kernel]:.2f}x")
                if cells[kernel] >= cells[ours]:
                    missed.append(f"T={num_tokens} ({ours})")
            else:
                ratios.append("-")
        lines.append(line + f"  {ratios[0]:>13}  {ratios[1]:>10}")
    if not any(kernel in cells for cells in by_t.values()):
        verdict = f"not measured (the {kernel} rows did not run)"
    else:
        verdict = "met" if not missed else "missed at " + ", ".join(missed)
    lines.append(f"target: the {kernel} route faster than ours (compiled and eager) at every "
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
    parser.add_argument("--routing", default="deepseek-v3", choices=sorted(ROUTINGS))
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
    routing = ROUTINGS[args.routing]
    print(f"{routing.title} on {name}; torch {torch.__version__}, flashinfer "
          f"{flashinfer_version()}", flush=True)
    rows, skipped = [], {}
    for num_tokens in tokens:
        rows += run_tokens(num_tokens, device, routing, args, skipped)
    for backend, reason in skipped.items():
        print(f"skipped {backend}: {reason}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        header = {"device": name, "torch": torch.__version__, "python": platform.python_version(),
                  "flashinfer": flashinfer_version(),
                  "date": datetime.date.today().isoformat(), "repeat": args.repeat,
                  "routing": {**dataclasses.asdict(routing), "dtype": str(routing.dtype)},
                  "skipped": skipped}
        with open(os.path.join(args.out, "route.json"), "w") as f:
            json.dump({"header": header, "rows": rows}, f, indent=1)
    print("\n".join(summary(rows, routing)))


if __name__ == "__main__":
    main()
