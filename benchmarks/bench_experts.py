"""Time the experts step of real MoE shapes on every available backend, bf16 and quantized.

    python benchmarks/bench_experts.py --out results/ [--shapes mixtral-8x7b,qwen3-30b-a3b] \\
        [--tokens 1,16] [--formats bf16,fp8_block,fp8_channel,mxfp4] \\
        [--peers hf,vllm,triton_kernels]
    python benchmarks/bench_experts.py --out DIR --smoke    # CPU, tiny shapes: checks the script
    python benchmarks/bench_experts.py --out DIR --flashinfer-rows [--shapes deepseek-v3]

For each shape, weight format and token count: routing weights and ids in, ``[T, H]``
out. Formats (weight_formats.py): ``bf16``; ``fp8_block`` (128 x 128 weight blocks,
fp8 activations per 1 x 128 group, as DeepSeek-V3 ships), ``fp8_channel`` (per output
row, fp8 activations per token), ``fp8_tensor``, and ``mxfp4`` (W4A16, as GPT-OSS
ships), each quantized from the same random bf16 weights by `torch_moe_ops.quant`.
Every format of one shape and token count routes the same tokens (seeded by T).

Our backends run their experts op (``experts``, or ``experts_quant`` for a quantized
format) as captured CUDA graphs (what a server replays); a backend without that op or
whose ``supports()`` refuses the format is skipped, and its reason is printed and kept
in ``experts.json``. The ``reference`` backend runs only where it is quick (it does
E/K times the FLOPs; quantized, it reads every weight back in fp32). vLLM's Triton
kernel runs where its source is at hand (see peer_vllm.py), captured too, in bf16 and
in its two fp8 modes (``fp8_block``, ``fp8_channel``). OpenAI's triton_kernels
(``matmul_ogs``, vLLM's MXFP4 path for GPT-OSS on Hopper) runs ``mxfp4`` rows with
``swiglu_oai`` where its source is at hand (see peer_triton_kernels.py), captured too,
on weights converted to its layout once per format, outside every timed region.
transformers' experts implementations (bf16 only) run as they come (they may sync with
the host, which a graph cannot capture) and compiled by Inductor, captured like ours.
Each time is the median of cold runs (`cold_median_seconds`): before each run a read of
1 GiB evicts L2 and leaves it clean. (``do_bench`` flushes by writing 256 MB, so a run begins by
writing back the dirty L2; on a 20-50 us decode call that added 8-10 us on an H200,
work no model step does.)

The floor of a row is the larger of the bytes its touched experts store in the
format (weights and scales) over the HBM read bandwidth (its byte floor, ``bytes_floor_us``:
what bounds a decode row) and its FLOPs over the dense rate of its GEMMs: an fp8
``torch._scaled_mm`` with per-row and per-column scales for w8a8 formats, a bf16 matmul
otherwise, all measured at the start of the same run. The tables give the fraction of the
floor a row reaches, and for decode rows (T = 1, 16) that of its byte floor.

``--backends`` times only the named backends of ours; ``--flashinfer-rows`` selects the
rows of FlashInfer's fused MoE beside ours and vLLM's (a few minutes on one GPU):
`FLASHINFER_ROWS`, each overridden by its own flag where given.
``rel_err`` compares a row with the first row of its format (the reference where it
ran); ``err_bf16`` with the unquantized experts on the same tokens.

Writes ``experts.csv``, ``experts.json`` and ``experts.png`` (latency against tokens,
one panel per format and shape) to ``--out``, prints every row, then the targets and
a short summary table last (summarize.py).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import platform
import statistics
import time
from collections.abc import Callable

# peer_triton_kernels, peer_vllm, summarize and weight_formats are siblings of this
# script, whose folder is on sys.path when it runs.
import peer_triton_kernels
import peer_vllm
import summarize
import torch
import triton
import triton.testing
import weight_formats
from weight_formats import ExpertWeights

import torch_moe_ops as tmo
from torch_moe_ops.backends.registry import REGISTRY, Problem
from torch_moe_ops.config import QuantSpec


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
    "gpt-oss-120b": Shape(128, 4, 2880, 2880, "swiglu_oai", True),
    "deepseek-v3": Shape(256, 8, 7168, 2048),
}
TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 16384)
# --smoke: widths that split into 128 x 128 blocks and 32-column groups; at T=1 each
# routed slot has 4 experts (vLLM's one-block-per-slot decode path), at 16 and 64 not.
SMOKE_SHAPES = {
    "smoke": Shape(8, 2, 256, 128),
    "smoke-oai": Shape(8, 2, 256, 128, "swiglu_oai", True),
}
SMOKE_TOKENS = (1, 16, 64)
# The dense reference does E/K times the useful FLOPs: run it only where that is quick.
REFERENCE_MAX_SECONDS = 0.02
# Quantized, it also reads all weights back in fp32 on every call: only this small.
REFERENCE_QUANT_MAX_BYTES = 2**28
# transformers' batched_mm gathers a weight matrix per row: skip it past this many bytes.
PEER_MAX_BYTES = 16 * 2**30
SWIGLU_ALPHA, SWIGLU_LIMIT = 1.702, 7.0
PEERS = ("hf", "vllm", "triton_kernels")
# --flashinfer-rows: FlashInfer's experts in its three formats beside triton, grouped_mm,
# vLLM's Triton kernel (bf16 and fp8) and triton_kernels (mxfp4) where their sources are at
# hand, prefill and decode.
FLASHINFER_ROWS = {"formats": "bf16,fp8_block,mxfp4", "tokens": "1,16,4096,16384",
                   "backends": "flashinfer,triton,grouped_mm", "peers": "vllm,triton_kernels"}


@dataclasses.dataclass(frozen=True)
class Ceilings:
    read_bytes_per_s: float
    bf16_flops_per_s: float
    fp8_flops_per_s: float

    def flops_per_s(self, spec: QuantSpec | None) -> float:
        """The dense rate that bounds GEMMs of weights in ``spec`` (None: bf16)."""
        return self.fp8_flops_per_s if weight_formats.uses_fp8_math(spec) else \
            self.bf16_flops_per_s


def median_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Median seconds of ``fn``: ``do_bench`` on a GPU, a few timed calls on the CPU."""
    if device.type == "cuda":
        return triton.testing.do_bench(fn, return_mode="median") * 1e-3
    fn()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_ceilings(device: torch.device | None = None) -> Ceilings:
    """HBM read bandwidth (sum over 4 GiB of bf16), dense bf16 matmul rate and fp8
    ``torch._scaled_mm`` rate with per-row and per-column fp32 scales (8192^3) on
    ``device`` (default the GPU); on the CPU, of sizes that take moments."""
    device = device or torch.device("cuda")
    cuda = device.type == "cuda"
    count, n = (2**31, 8192) if cuda else (2**24, 256)
    data = torch.randn(count, device=device, dtype=torch.bfloat16)
    read_s = median_seconds(data.sum, device)
    data = None  # 4 GiB: free it before the matmuls' inputs
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    mm_s = median_seconds(lambda: a @ b, device)
    # _scaled_mm takes its second operand column-major.
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    scale_a = torch.ones(n, 1, device=device)
    scale_b = torch.ones(1, n, device=device)
    fp8_s = median_seconds(lambda: torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b,
                                                    out_dtype=torch.bfloat16), device)
    flops = 2 * n**3
    return Ceilings(count * 2 / read_s, flops / mm_s, flops / fp8_s)


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


def _randn(*size, scale, generator, dtype=torch.bfloat16):
    return (torch.randn(*size, device=generator.device, generator=generator) * scale).to(dtype)


def make_weights(shape: Shape, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16):
    """``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``b13 [E, 2I]?``, ``b2 [E, H]?`` in ``dtype``,
    on the generator's device."""
    E, H, I = shape.num_experts, shape.hidden, shape.inter
    random = dict(generator=generator, dtype=dtype)
    return (_randn(E, 2 * I, H, scale=H**-0.5, **random),
            _randn(E, H, I, scale=I**-0.5, **random),
            _randn(E, 2 * I, scale=0.1, **random) if shape.bias else None,
            _randn(E, H, scale=0.1, **random) if shape.bias else None)


def make_problem(shape: Shape, num_tokens: int, weights, generator: torch.Generator):
    """Tokens (in the weights' dtype) routed by softmax top-k over random logits, plus
    the shared weights."""
    hidden_TH = _randn(num_tokens, shape.hidden, scale=1.0, generator=generator,
                       dtype=weights[0].dtype)
    logits_TE = torch.randn(num_tokens, shape.num_experts, device=generator.device,
                            generator=generator)
    topk_weights_TK, topk_ids_TK = torch.ops.moe.route(logits_TE, None, shape.top_k, "softmax",
                                                       True, 1, 1, 1.0)
    return (hidden_TH, topk_weights_TK, topk_ids_TK, *weights)


def floor_seconds(shape: Shape, num_tokens: int, topk_ids_TK: torch.Tensor,
                  ceilings: Ceilings, weights: ExpertWeights | None = None
                  ) -> tuple[float, float, float, str]:
    """``(floor, bytes, FLOPs, bound)`` of one call on ``weights`` (bf16 when None); the
    byte floor is ``bytes / ceilings.read_bytes_per_s``."""
    touched = torch.unique(topk_ids_TK).numel()
    expert_bytes = (3 * shape.hidden * shape.inter * 2 if weights is None
                    else weights.bytes_per_expert())
    weight_bytes = touched * expert_bytes
    flops = 2 * num_tokens * shape.top_k * 3 * shape.hidden * shape.inter
    memory_s = weight_bytes / ceilings.read_bytes_per_s
    compute_s = flops / ceilings.flops_per_s(None if weights is None else weights.spec)
    bound = "memory" if memory_s >= compute_s else "compute"
    return max(memory_s, compute_s), weight_bytes, flops, bound


def graph_timer(fn: Callable[[], torch.Tensor], repeat: int = 1
                ) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture ``fn``, called ``repeat`` times, in one CUDA graph (after a warm-up
    call on a side stream: compilation and JIT builds happen there); returns its
    replay and the output the last call writes."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeat):
            out = fn()
    return graph.replay, out


@dataclasses.dataclass
class Bench:
    """Where and how rows run: on the GPU (bf16, CUDA graphs, cold CUDA-event medians)
    or, with ``--smoke``, on the CPU (fp32, plain calls, one timed call each).
    ``skipped`` keeps each (shape, format, backend) left out, with its reason."""

    device: torch.device
    dtype: torch.dtype
    ceilings: Ceilings
    peers: frozenset[str]
    flush_buffer: torch.Tensor | None = None
    # Our backends to time (None: every registered one).
    backends: frozenset[str] | None = None
    skipped: list[dict] = dataclasses.field(default_factory=list)

    @property
    def smoke(self) -> bool:
        return self.device.type == "cpu"

    def prepare(self, fn: Callable[[], torch.Tensor], capture: bool
                ) -> tuple[Callable[[], object], torch.Tensor]:
        """What to time (the graph's replay where ``capture`` and on a GPU, else
        ``fn``) and the output it writes, after one run."""
        if capture and not self.smoke:
            replay, out = graph_timer(fn)
            out.fill_(float("nan"))
            replay()
            return replay, out
        return fn, fn()

    def seconds(self, timed: Callable[[], object]) -> float:
        if self.smoke:
            # The CPU run checks the script, not speed: one call is timed.
            start = time.perf_counter()
            timed()
            return time.perf_counter() - start
        return cold_median_seconds(timed, self.flush_buffer)

    def skip(self, shape_name: str, format_name: str, backend: str, reason: str) -> None:
        entry = {"shape": shape_name, "format": format_name, "backend": backend,
                 "reason": reason}
        if entry not in self.skipped:
            self.skipped.append(entry)
            print(f"{shape_name} {format_name} {backend}: skipped: {reason}", flush=True)


def our_backends(shape_name: str, shape: Shape, num_tokens: int, weights: ExpertWeights,
                 bench: Bench) -> dict[str, str]:
    """``{name: namespace}`` of our experts backends that run ``weights`` here."""
    problem = Problem(bench.dtype, num_experts=shape.num_experts,
                      num_local_experts=shape.num_experts, hidden_size=shape.hidden,
                      intermediate_size=shape.inter, top_k=shape.top_k,
                      activation=shape.activation, quant=weights.spec)
    names = {}
    for backend in REGISTRY.experts.values():
        if bench.backends is not None and backend.name not in bench.backends:
            continue
        # As "auto" sees it: on the CPU that leaves the Triton interpreter out.
        reason = backend.why_not(tmo.BackendSpec(), problem, bench.device)
        if reason is None and backend.name == "reference":
            reason = _reference_too_slow(shape, num_tokens, weights)
        if reason is not None:
            bench.skip(shape_name, weights.format, backend.name, reason)
            continue
        names[backend.name] = backend.namespace
    return names


def _reference_too_slow(shape: Shape, num_tokens: int, weights: ExpertWeights) -> str | None:
    dense_flops = 2 * num_tokens * shape.num_experts * 3 * shape.hidden * shape.inter
    if dense_flops / 500e12 > REFERENCE_MAX_SECONDS:
        return "not timed at these widths and tokens (dense: E/K times the FLOPs)"
    dequantized_bytes = shape.num_experts * 3 * shape.hidden * shape.inter * 4
    if weights.spec is not None and dequantized_bytes > REFERENCE_QUANT_MAX_BYTES:
        return "not timed at these widths (reads every weight back in fp32 on each call)"
    return None


def transformers_peers(shape: Shape, num_tokens: int, problem, compiled: bool = True):
    """transformers' experts implementations on the same weights (shared, same layout),
    eager (``hf-<impl>``: run as they come, they may sync with the host) and, with
    ``compiled``, compiled (``hf-<impl>-compiled``: Inductor with ``fullgraph=True``,
    captured in a CUDA graph as ours are; that is what ``mode="reduce-overhead"``
    replays, without its per-call host cost). Returns ``{name: (fn, capture)}``."""
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
        if compiled and impl != "eager":
            module = torch.compile(experts, fullgraph=True)
            peers[f"hf-{impl}-compiled"] = (
                lambda module=module: module(hidden_TH, ids_TK, weights_TK), True)
    return peers


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-12)).item()


def triton_kernels_weights(shape_name: str, shape: Shape, weights: ExpertWeights, bench: Bench
                           ) -> peer_triton_kernels.KernelWeights | None:
    """``weights`` in triton_kernels' layout, converted once per shape and format (outside
    every timed region), or None where that peer is not asked for or does not run (its
    reason kept as a skip)."""
    if "triton_kernels" not in bench.peers:
        return None
    reason = peer_triton_kernels.why_not(shape, weights.spec, bench.device)
    if reason is None:
        try:
            return peer_triton_kernels.kernel_weights(weights)
        except Exception as e:  # noqa: BLE001 (one peer failing must not end the run)
            reason = f"its weight conversion failed: {type(e).__name__}: {e}"
    bench.skip(shape_name, weights.format, peer_triton_kernels.NAME, reason)
    return None


def candidates(shape_name: str, shape: Shape, num_tokens: int, routing, weights: ExpertWeights,
               bf16_weights, bench: Bench,
               triton_kernels: peer_triton_kernels.KernelWeights | None = None
               ) -> dict[str, tuple[Callable, bool]]:
    """``{name: (fn, capture)}`` of every backend and peer that runs this row, the
    reference first where it runs (the others are checked against it); ``triton_kernels``:
    the weights that peer reads (`triton_kernels_weights`), None where it does not run."""
    hidden_TH, topk_weights_TK, topk_ids_TK = routing
    static = (shape.activation, SWIGLU_ALPHA, SWIGLU_LIMIT)
    found: dict[str, tuple[Callable, bool]] = {}
    backends = sorted(our_backends(shape_name, shape, num_tokens, weights, bench).items(),
                      key=lambda b: b[0] != "reference")
    for name, namespace in backends:
        op = weights.op(namespace)
        found[name] = (lambda op=op: op(hidden_TH, topk_weights_TK, topk_ids_TK,
                                        *weights.op_args(), *static), True)
    if "hf" in bench.peers and weights.spec is None:
        found.update(transformers_peers(shape, num_tokens, (*routing, *bf16_weights),
                                        compiled=not bench.smoke))
    if triton_kernels is not None:
        found[peer_triton_kernels.NAME] = (peer_triton_kernels.triton_kernels_run(
            routing, triton_kernels, (SWIGLU_ALPHA, SWIGLU_LIMIT)), True)
    if "vllm" in bench.peers:
        reason = peer_vllm.why_not(shape, weights.spec, bench.device)
        if reason is not None:
            bench.skip(shape_name, weights.format, "vllm-triton", reason)
            return found
        problem = (*routing, weights.w13, weights.w2, weights.b13_EF, weights.b2_EH)
        scales = None if weights.spec is None else (weights.w13_scale, weights.w2_scale)
        for name, fn in peer_vllm.vllm_peers(shape, num_tokens, problem, weights.spec,
                                             scales).items():
            found[name] = (fn, True)
    return found


def bench_one(shape_name: str, shape: Shape, num_tokens: int, weights: ExpertWeights,
              bf16_weights, bench: Bench,
              triton_kernels: peer_triton_kernels.KernelWeights | None = None) -> list[dict]:
    """The rows of one shape, format and token count (``triton_kernels`` as `candidates`
    takes it)."""
    # Seeded by T alone: every format of this shape and T routes the same tokens.
    generator = torch.Generator(device=bench.device).manual_seed(num_tokens)
    routing = make_problem(shape, num_tokens, bf16_weights, generator)[:3]
    floor_s, weight_bytes, flops, bound = floor_seconds(shape, num_tokens, routing[2],
                                                        bench.ceilings, weights)
    unquantized_TH = torch.ops.moe.experts(*routing, *bf16_weights, shape.activation,
                                           SWIGLU_ALPHA, SWIGLU_LIMIT)
    baseline: torch.Tensor | None = None
    rows = []
    for name, (fn, capture) in candidates(shape_name, shape, num_tokens, routing, weights,
                                          bf16_weights, bench, triton_kernels).items():
        try:
            timed, out = bench.prepare(fn, capture)
            if baseline is None:
                baseline = out.clone()
            error = relative_error(out, baseline)
            seconds = bench.seconds(timed)
        except torch.OutOfMemoryError:
            print(f"{shape_name} {weights.format} T={num_tokens} {name}: out of memory",
                  flush=True)
            torch.cuda.empty_cache()
            continue
        except Exception as e:  # noqa: BLE001 (one backend failing must not end the run)
            print(f"{shape_name} {weights.format} T={num_tokens} {name}: failed: "
                  f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}",
                  flush=True)
            continue
        rows.append({
            "shape": shape_name, "tokens": num_tokens, "format": weights.format,
            "backend": name, "us": seconds * 1e6, "floor_us": floor_s * 1e6, "bound": bound,
            "pct_floor": 100 * floor_s / seconds,
            "bytes_floor_us": weight_bytes / bench.ceilings.read_bytes_per_s * 1e6,
            "tb_per_s": weight_bytes / seconds / 1e12, "tflop_per_s": flops / seconds / 1e12,
            "rel_err": error, "err_bf16": relative_error(out, unquantized_TH),
            "nan": bool(out.isnan().any()),
        })
        print(f"{shape_name} {weights.format} T={num_tokens} {name}: {seconds * 1e6:.1f} us, "
              f"{100 * floor_s / seconds:.0f}% of the floor", flush=True)
    return rows


def plot(rows: list[dict], path: str) -> None:
    """One panel per format (rows) and shape (columns): time against tokens per backend."""
    try:
        import matplotlib
    except ImportError:
        print(f"{path} not drawn: matplotlib is not installed (pip install matplotlib)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = list(dict.fromkeys(r.get("format", "bf16") for r in rows))
    shapes = sorted({r["shape"] for r in rows})
    backends = sorted({r["backend"] for r in rows})
    colors = dict(zip(backends, plt.rcParams["axes.prop_cycle"].by_key()["color"] * 4))
    fig, axes = plt.subplots(len(formats), len(shapes),
                             figsize=(5 * len(shapes), 4.5 * len(formats)), squeeze=False)
    for ax_row, fmt in zip(axes, formats):
        for ax, shape in zip(ax_row, shapes):
            cells = [r for r in rows if r["shape"] == shape and r.get("format", "bf16") == fmt]
            for backend in sorted({r["backend"] for r in cells}):
                points = sorted((r["tokens"], r["us"]) for r in cells if r["backend"] == backend)
                ax.plot(*zip(*points), marker="o", label=backend, color=colors[backend])
            floor = sorted({(r["tokens"], r["floor_us"]) for r in cells})
            if floor:
                ax.plot(*zip(*floor), "k--", label="floor")
                ax.legend(fontsize=7)
            ax.set(xscale="log", yscale="log", title=f"{shape} {fmt}", xlabel="tokens",
                   ylabel="us")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_results(out: str, header: dict, rows: list[dict], draw: bool = True) -> None:
    """``experts.json`` (header and rows), ``experts.csv`` and, with ``draw``,
    ``experts.png`` in ``out``."""
    with open(os.path.join(out, "experts.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    if not rows:
        return
    with open(os.path.join(out, "experts.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    if draw:
        plot(rows, os.path.join(out, "experts.png"))


def run(bench: Bench, shapes: dict[str, Shape], tokens: list[int], formats: list[str],
        out: str, header: dict) -> list[dict]:
    """Every row, written to ``out`` as each format of a shape ends (so a run stopped
    by a time limit keeps what it finished)."""
    header["skipped"] = bench.skipped
    generator = torch.Generator(device=bench.device).manual_seed(0)
    rows = []
    for shape_name, shape in shapes.items():
        bf16_weights = make_weights(shape, generator, bench.dtype)
        for format_name in formats:
            reason = weight_formats.why_not(format_name, shape.hidden, shape.inter)
            if reason is not None:
                bench.skip(shape_name, format_name, "every backend", reason)
                continue
            weights = weight_formats.expert_weights(format_name, *bf16_weights)
            peer_weights = triton_kernels_weights(shape_name, shape, weights, bench)
            for num_tokens in tokens:
                rows += bench_one(shape_name, shape, num_tokens, weights, bf16_weights, bench,
                                  peer_weights)
            del weights, peer_weights
            if not bench.smoke:
                torch.cuda.empty_cache()
            write_results(out, header, rows, draw=False)
        del bf16_weights
    write_results(out, header, rows)
    return rows


def _names(text: str | None, table, what: str) -> list:
    """The names of a comma-separated ``--what`` value, each a key of ``table``
    (all of them when ``text`` is None)."""
    if text is None:
        return list(table)
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in table]
    if unknown or not names:
        raise SystemExit(f"--{what} must be comma-separated names from {', '.join(table)}, "
                         f"got {text!r}")
    return names


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".")
    parser.add_argument("--shapes", help=f"comma-separated, of {', '.join(SHAPES)} (default all)")
    parser.add_argument("--tokens", help=f"comma-separated T (default {TOKENS})")
    parser.add_argument("--formats",
                        help=f"comma-separated, of {', '.join(weight_formats.FORMATS)} "
                             f"(default {','.join(weight_formats.DEFAULT_FORMATS)})")
    parser.add_argument("--peers", help="comma-separated peers to time beside ours: "
                                        f"{', '.join(PEERS)} (or none; default all)")
    parser.add_argument("--backends", help="comma-separated backends of ours to time "
                                           "(default all that run)")
    parser.add_argument("--flashinfer-rows", action="store_true",
                        help="FlashInfer's experts beside ours and vLLM's: " + ", ".join(
                            f"--{flag} {value}" for flag, value in FLASHINFER_ROWS.items())
                        + " (each unless given)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes on the CPU in fp32: checks the script (the Triton "
                             "kernels run only under TRITON_INTERPRET=1)")
    parser.add_argument("--plot-only", metavar="JSON",
                        help="redraw experts.png from an earlier run's experts.json")
    args = parser.parse_args(argv)
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f)["rows"], os.path.join(args.out, "experts.png"))
        return
    if args.flashinfer_rows:
        for flag, value in FLASHINFER_ROWS.items():
            if getattr(args, flag) is None:
                setattr(args, flag, value)
    formats = _names(args.formats or ",".join(weight_formats.DEFAULT_FORMATS),
                     weight_formats.FORMATS, "formats")
    peers_text = args.peers or ",".join(PEERS)
    peers = frozenset(() if peers_text == "none" else _names(peers_text, PEERS, "peers"))
    backends = (None if args.backends is None
                else frozenset(_names(args.backends, REGISTRY.experts, "backends")))
    shape_table = SMOKE_SHAPES if args.smoke else SHAPES
    shapes = {name: shape_table[name] for name in _names(args.shapes, shape_table, "shapes")}
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else list(
        SMOKE_TOKENS if args.smoke else TOKENS)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("bench_experts.py needs a CUDA GPU; --smoke runs tiny shapes on the CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    os.makedirs(args.out, exist_ok=True)
    if "hf" in peers and not args.smoke:
        # The compiled peers recompile per shape and token count.
        torch._dynamo.config.recompile_limit = 1024
    ceilings = measure_ceilings(device)
    bench = Bench(device, torch.float32 if args.smoke else torch.bfloat16, ceilings, peers,
                  None if args.smoke else torch.empty(2**28, device=device,
                                                      dtype=torch.float32), backends=backends)
    header = {
        "device": (f"CPU {platform.machine()}" if args.smoke
                   else torch.cuda.get_device_name()),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "triton": triton.__version__,
        # The vLLM release the vllm-triton peer ran from; None when there was none.
        "vllm": peer_vllm.source_version() if "vllm" in peers else None,
        # Where the triton-kernels peer's code came from; None when it had none.
        "triton_kernels": (peer_triton_kernels.source_version() if "triton_kernels" in peers
                           else None),
        "read_tb_per_s": ceilings.read_bytes_per_s / 1e12,
        "bf16_tflop_per_s": ceilings.bf16_flops_per_s / 1e12,
        "fp8_tflop_per_s": ceilings.fp8_flops_per_s / 1e12,
        "formats": formats, "smoke": args.smoke,
        "backends": None if backends is None else sorted(backends),
    }
    print(json.dumps(header), flush=True)
    rows = run(bench, shapes, tokens, formats, args.out, header)
    print(summarize.row_table(rows))
    print("\n" + "\n".join(summarize.target_lines(rows)))
    print("\n" + summarize.summary_table(rows))

if __name__ == "__main__":
    main()
