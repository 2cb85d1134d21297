"""Time the experts step of real MoE shapes on every available backend.

    python benchmarks/bench_experts.py --out results/ [--shapes mixtral,qwen3] [--tokens 1,16]

For each shape and token count: routing weights and ids in, ``[T, H]`` out. Our
backends run as captured CUDA graphs (what a server replays), and so does vLLM's
Triton kernel where its source is at hand (see peer_vllm.py); transformers'
experts implementations run as they come (they may sync with the host, which a
graph cannot capture) and compiled by Inductor, captured like ours. Each time
is the median of cold runs (`cold_median_seconds`): before each run a read of
1 GiB evicts L2 and leaves it clean. (``do_bench`` flushes by writing 256 MB, so
a run begins by writing back the dirty L2; on a 20-50 us decode call that added
8-10 us on an H200, work no model step does.) The floor of a row is the larger
of the bytes of the experts it touches over the HBM read bandwidth and its FLOPs over
the dense bf16 rate, both measured at the start of the same run.

Writes ``experts.csv``, ``experts.json`` and ``experts.png`` (latency against
tokens, one line per backend and shape) to ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import statistics
from collections.abc import Callable

import torch
import triton
import triton.testing

# A sibling of this script, whose folder is on sys.path when it runs.
from peer_vllm import source_version, vllm_peers

import torch_moe_ops as tmo
from torch_moe_ops.backends.registry import REGISTRY, Problem


@dataclasses.dataclass(frozen=True)
class Shape:
    num_experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str = "silu"
    bias: bool = False


SHAPES = {
    "mixtral-8x7b": Shape(8, 2, 4096, 14336),
    "qwen3-30b-a3b": Shape(128, 8, 2048, 768),
    "olmoe": Shape(64, 8, 2048, 1024),
    "gpt-oss-20b": Shape(32, 4, 2880, 2880, "swiglu_oai", True),
    "deepseek-v3": Shape(256, 8, 7168, 2048),
}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
# The dense reference does E/K times the useful FLOPs: run it only where that is quick.
REFERENCE_MAX_SECONDS = 0.02
# transformers' batched_mm gathers a weight matrix per row: skip it past this many bytes.
PEER_MAX_BYTES = 16 * 2**30


@dataclasses.dataclass(frozen=True)
class Ceilings:
    read_bytes_per_s: float
    bf16_flops_per_s: float


def measure_ceilings() -> Ceilings:
    """HBM read bandwidth (sum over 4 GiB of bf16) and dense bf16 matmul rate (8192^3)."""
    data = torch.randn(2**31, device="cuda", dtype=torch.bfloat16)
    read_ms = triton.testing.do_bench(data.sum, return_mode="median")
    data = None  # 4 GiB: free it before the matmul's inputs
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm_ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    return Ceilings(2**32 / (read_ms * 1e-3), 2 * 8192**3 / (mm_ms * 1e-3))


def cold_median_seconds(fn: Callable[[], object], flush_buffer: torch.Tensor,
                        budget_s: float = 0.2, max_runs: int = 200) -> float:
    """Median seconds of ``fn`` over CUDA-event-timed runs, each after a read of
    ``flush_buffer`` (bigger than L2) so no run finds weights in L2."""
    fn()
    torch.cuda.synchronize()
    times = []
    spent = 0.0
    while len(times) < max_runs and (len(times) < 5 or spent < budget_s):
        flush_buffer.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
        spent += times[-1]
    return statistics.median(times)


def _randn(*size, scale, generator):
    return (torch.randn(*size, device="cuda", generator=generator) * scale).to(torch.bfloat16)


def make_weights(shape: Shape, generator: torch.Generator):
    """``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``b13 [E, 2I]?``, ``b2 [E, H]?`` in bf16."""
    E, H, I = shape.num_experts, shape.hidden, shape.inter
    return (_randn(E, 2 * I, H, scale=H**-0.5, generator=generator),
            _randn(E, H, I, scale=I**-0.5, generator=generator),
            _randn(E, 2 * I, scale=0.1, generator=generator) if shape.bias else None,
            _randn(E, H, scale=0.1, generator=generator) if shape.bias else None)


def make_problem(shape: Shape, num_tokens: int, weights, generator: torch.Generator):
    """Tokens routed by softmax top-k over random logits, plus the shared weights."""
    hidden_TH = _randn(num_tokens, shape.hidden, scale=1.0, generator=generator)
    logits_TE = torch.randn(num_tokens, shape.num_experts, device="cuda", generator=generator)
    topk_weights_TK, topk_ids_TK = torch.ops.moe.route(logits_TE, None, shape.top_k, "softmax",
                                                       True, 1, 1, 1.0)
    return (hidden_TH, topk_weights_TK, topk_ids_TK, *weights)


def floor_seconds(shape: Shape, num_tokens: int, topk_ids_TK: torch.Tensor,
                  ceilings: Ceilings) -> tuple[float, float, float, str]:
    touched = torch.unique(topk_ids_TK).numel()
    weight_bytes = touched * 3 * shape.hidden * shape.inter * 2
    flops = 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.inter
    memory_s = weight_bytes / ceilings.read_bytes_per_s
    compute_s = flops / ceilings.bf16_flops_per_s
    bound = "memory" if memory_s >= compute_s else "compute"
    return max(memory_s, compute_s), weight_bytes, flops, bound


def graph_timer(fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture ``fn`` in a CUDA graph; returns its replay and the output it writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def our_backends(shape: Shape, num_tokens: int) -> dict[str, str]:
    device = torch.device("cuda")
    names = {}
    for backend in REGISTRY.experts.values():
        if backend.supports(tmo.BackendSpec(), Problem(torch.bfloat16), device) is not None:
            continue
        if backend.name == "reference":
            dense_flops = 2 * num_tokens * shape.num_experts * 3 * shape.hidden * shape.inter
            if dense_flops / 500e12 > REFERENCE_MAX_SECONDS:
                continue
        names[backend.name] = backend.namespace
    return names


def transformers_peers(shape: Shape, num_tokens: int, problem):
    """transformers' experts implementations on the same weights (shared, same layout),
    eager (``hf-<impl>``: run as they come, they may sync with the host) and compiled
    (``hf-<impl>-compiled``: Inductor with ``fullgraph=True``, captured in a CUDA
    graph as ours are; that is what ``mode="reduce-overhead"`` replays, without its
    per-call host cost). Returns ``{name: (fn, capture)}``."""
    try:
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts
    except ImportError:
        return {}
    if shape.activation != "silu" or shape.bias:
        return {}
    hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, _, _ = problem
    ids_TK, weights_TK = topk_ids_TK.long(), topk_weights_TK.to(hidden_TH.dtype)
    peers = {}
    gathered_bytes = num_tokens * shape.top_k * 3 * shape.hidden * shape.inter * 2
    for impl in ("grouped_mm", "batched_mm", "eager"):
        if impl == "batched_mm" and gathered_bytes > PEER_MAX_BYTES:
            continue
        # One module per implementation: the choice is read from its config.
        config = MixtralConfig(hidden_size=shape.hidden, intermediate_size=shape.inter,
                               num_local_experts=shape.num_experts,
                               num_experts_per_tok=shape.top_k)
        config._experts_implementation = impl
        with torch.device("meta"):
            experts = MixtralExperts(config)
        experts.gate_up_proj = torch.nn.Parameter(w13_EFH, requires_grad=False)
        experts.down_proj = torch.nn.Parameter(w2_EHI, requires_grad=False)
        peers[f"hf-{impl}"] = (lambda experts=experts: experts(hidden_TH, ids_TK, weights_TK),
                               False)
        if impl != "eager":
            compiled = torch.compile(experts, fullgraph=True)
            peers[f"hf-{impl}-compiled"] = (
                lambda compiled=compiled: compiled(hidden_TH, ids_TK, weights_TK), True)
    return peers


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def bench_one(shape_name: str, shape: Shape, num_tokens: int, weights, ceilings: Ceilings,
              generator: torch.Generator, flush_buffer: torch.Tensor) -> list[dict]:
    problem = make_problem(shape, num_tokens, weights, generator)
    hidden_TH, topk_weights_TK, topk_ids_TK, *weights = problem
    floor_s, weight_bytes, flops, bound = floor_seconds(shape, num_tokens, topk_ids_TK, ceilings)
    static = (shape.activation, 1.702, 7.0)
    candidates: dict[str, tuple[Callable, bool]] = {}
    # The reference, where it runs, goes first: it is what the others are checked against.
    backends = sorted(our_backends(shape, num_tokens).items(), key=lambda b: b[0] != "reference")
    for name, namespace in backends:
        op = getattr(torch.ops, namespace).experts
        candidates[name] = (lambda op=op: op(hidden_TH, topk_weights_TK, topk_ids_TK,
                                              *weights, *static), True)
    candidates.update(transformers_peers(shape, num_tokens, problem))
    for name, fn in vllm_peers(shape, num_tokens, problem).items():
        candidates[name] = (fn, True)
    baseline: torch.Tensor | None = None
    rows = []
    for name, (fn, capture) in candidates.items():
        try:
            if capture:
                replay, out = graph_timer(fn)
                out.fill_(float("nan"))
                replay()
                timed = replay
            else:
                out = fn()
                timed = fn
            if baseline is None:
                baseline = out.clone()
            error = relative_error(out, baseline)
            seconds = cold_median_seconds(timed, flush_buffer)
        except torch.OutOfMemoryError:
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # noqa: BLE001 (one backend failing must not end the run)
            print(f"{shape_name} T={num_tokens} {name}: failed: {type(e).__name__}: "
                  f"{str(e).splitlines()[-1] if str(e) else ''}", flush=True)
            continue
        rows.append({
            "shape": shape_name, "tokens": num_tokens, "backend": name,
            "us": seconds * 1e6, "floor_us": floor_s * 1e6, "bound": bound,
            "pct_floor": 100 * floor_s / seconds,
            "tb_per_s": weight_bytes / seconds / 1e12, "tflop_per_s": flops / seconds / 1e12,
            "rel_err": error, "nan": bool(out.isnan().any()),
        })
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for r in rows})
    backends = sorted({r["backend"] for r in rows})
    colors = dict(zip(backends, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(5 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for backend in sorted({r["backend"] for r in rows if r["shape"] == shape}):
            points = sorted((r["tokens"], r["us"]) for r in rows
                            if r["shape"] == shape and r["backend"] == backend)
            ax.plot(*zip(*points), marker="o", label=backend, color=colors[backend])
        floor = sorted({(r["tokens"], r["floor_us"]) for r in rows if r["shape"] == shape})
        ax.plot(*zip(*floor), "k--", label="floor")
        ax.set(xscale="log", yscale="log", title=shape, xlabel="tokens", ylabel="us")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    parser.add_argument("--plot-only", metavar="JSON",
                        help="redraw experts.png from an earlier run's experts.json")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f)["rows"], os.path.join(args.out, "experts.png"))
        return
    os.makedirs(args.out, exist_ok=True)
    # The compiled peers recompile per shape and token count.
    torch._dynamo.config.recompile_limit = 1024
    ceilings = measure_ceilings()
    header = {
        "device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "triton": triton.__version__,
        # The vLLM release the vllm-triton peer ran from; None when there was none.
        "vllm": source_version(),
        "read_tb_per_s": ceilings.read_bytes_per_s / 1e12,
        "bf16_tflop_per_s": ceilings.bf16_flops_per_s / 1e12,
    }
    print(json.dumps(header))
    generator = torch.Generator(device="cuda").manual_seed(0)
    flush_buffer = torch.empty(2**28, device="cuda", dtype=torch.float32)
    rows = []
    for shape_name in args.shapes.split(","):
        weights = make_weights(SHAPES[shape_name], generator)
        for num_tokens in map(int, args.tokens.split(",")):
            rows += bench_one(shape_name, SHAPES[shape_name], num_tokens, weights, ceilings,
                              generator, flush_buffer)
        del weights
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "experts.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    with open(os.path.join(args.out, "experts.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.join(args.out, "experts.png"))
    print(f"{'shape':14} {'T':>6} {'backend':14} {'us':>10} {'floor':>9} {'%floor':>7} "
          f"{'TB/s':>6} {'TFLOP/s':>8} {'err':>8}")
    for r in rows:
        print(f"{r['shape']:14} {r['tokens']:>6} {r['backend']:14} {r['us']:>10.1f} "
              f"{r['floor_us']:>9.1f} {r['pct_floor']:>6.1f}% {r['tb_per_s']:>6.2f} "
              f"{r['tflop_per_s']:>8.1f} {r['rel_err']:>8.1e}"
              + (" NaN!" if r["nan"] else ""))


if __name__ == "__main__":
    main()
