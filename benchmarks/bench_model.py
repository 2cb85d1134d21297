"""Whole transformers models at real widths: our patch against compiled transformers.

    python benchmarks/bench_model.py --shapes qwen3-30b-a3b --out results/model-qwen3

Each shape is a transformers model with the real hidden size, experts, top-k,
attention and vocabulary of the named checkpoint, a few layers and random bf16
weights. A row is one forward of ``input_ids [B, S]`` without KV cache: decode
rows (S = 1) run as CUDA graphs (``mode="reduce-overhead"``), prefill rows as
plain Inductor graphs. The ways, all under ``torch.compile(fullgraph=True)``:

- ``hf-grouped_mm`` / ``hf-batched_mm``: transformers with that experts
  implementation (batched_mm only where its per-row weight gather fits);
- ``tmo-patch``: ``torch_moe_ops.hf.patch`` and ``torch_moe_ops.backend(mode=...)``;
- ``hf+tmo-experts``: transformers' routing, ``experts_implementation="torch_moe_ops"``.

Per row: ms per forward (CUDA events around back-to-back calls, as a serving
loop issues them, so host work that the GPU waits for counts), the GPU's kernel
time per forward from a profile (the rest is time the GPU waited: launches,
Python, gaps between graphs), host syncs per forward, and the MoE block alone
(the first layer's block, compiled the same way, same input) in ms: for decode
rows the GPU time of one call inside a CUDA graph of 20 calls (a compiled
call's host cost, about 0.1-0.2 ms whatever the block, would otherwise hide the
block), for prefill rows back-to-back calls.

Writes ``model.json`` and ``model.md`` to ``--out`` and prints a table last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
from collections.abc import Callable

import torch
import transformers

import torch_moe_ops as tmo
import torch_moe_ops.hf  # registers the "torch_moe_ops" experts implementation
from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec
from torch_moe_ops.hf.block import HFMoEBlock
from torch_moe_ops.hf.weights import QuantizedExperts, quantized_weights

# Legend: B batch, S sequence, T = B * S tokens, H hidden size, V vocabulary.


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """A transformers config at a checkpoint's real widths; ``layers`` decoder layers."""

    config_class: str
    layers: int
    kwargs: dict

    def config(self, layers: int | None = None) -> transformers.PretrainedConfig:
        cls = getattr(transformers, self.config_class)
        return cls(num_hidden_layers=layers or self.layers, **self.kwargs)


SHAPES = {
    "qwen3-30b-a3b": ModelShape("Qwen3MoeConfig", 4, dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128)),
    "olmoe": ModelShape("OlmoeConfig", 4, dict(
        vocab_size=50304, hidden_size=2048, intermediate_size=1024, num_experts=64,
        num_experts_per_tok=8, num_attention_heads=16, num_key_value_heads=16)),
    "mixtral-8x7b": ModelShape("MixtralConfig", 2, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_local_experts=8,
        num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8)),
    "gpt-oss-20b": ModelShape("GptOssConfig", 4, dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32,
        num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        sliding_window=128)),
    "deepseek-v3": ModelShape("DeepseekV3Config", 1, dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        n_shared_experts=1, first_k_dense_replace=0, routed_scaling_factor=2.5,
        norm_topk_prob=True, num_attention_heads=128, num_key_value_heads=128,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128)),
}
DECODE_BATCHES = (1, 8, 64, 256)
PREFILL = ((1, 2048), (4, 4096))
WAYS = ("hf-grouped_mm", "hf-batched_mm", "tmo-patch", "hf+tmo-experts")
# batched_mm gathers a [2I, H] and an [H, I] matrix per (token, slot): skip it past this.
BATCHED_MM_MAX_BYTES = 16 * 2**30


def rows_of(decode: tuple[int, ...], prefill: tuple[tuple[int, int], ...]):
    return [(b, 1) for b in decode] + list(prefill)


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sparse-MoE block of each decoder layer (transformers' or a patched one)."""
    blocks = []
    for layer in model.model.layers:
        block = getattr(layer, "mlp", None)
        if block is not None and any(n in ("experts",) for n, _ in block.named_children()):
            blocks.append(block)
    return blocks


def batched_mm_fits(cfg: transformers.PretrainedConfig, tokens: int) -> bool:
    moe = moe_sizes(cfg)
    return tokens * moe["top_k"] * 3 * moe["hidden"] * moe["inter"] * 2 <= BATCHED_MM_MAX_BYTES


def moe_sizes(cfg) -> dict:
    inter = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    return {"hidden": cfg.hidden_size, "inter": inter, "top_k": cfg.num_experts_per_tok}


def build(shape: ModelShape, way: str, layers: int | None, device: str = "cuda",
          dtype: torch.dtype = torch.bfloat16, quant: QuantSpec | None = None
          ) -> torch.nn.Module:
    """The model for ``way``, random weights made on ``device`` from seed 0 (the
    same for every way).

    With ``quant``, ``tmo-patch`` stores and runs the experts in that format
    (`quantize_patched_experts`), and transformers' ways run the same values rounded back to
    ``dtype`` (`round_experts`), as transformers runs a quantized checkpoint it has no
    kernels for (GPT-OSS's MXFP4 without its hub kernels)."""
    torch.manual_seed(0)
    impl = {"hf-grouped_mm": "grouped_mm", "hf-batched_mm": "batched_mm",
            "hf+tmo-experts": "torch_moe_ops", "tmo-patch": "grouped_mm"}[way]
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            shape.config(layers), dtype=dtype, experts_implementation=impl)
    model.eval()
    if way == "tmo-patch":
        report = tmo.hf.patch(model)
        if not report.blocks:
            raise RuntimeError(f"patch replaced no block: {report}")
        if quant is not None:
            quantize_patched_experts(model, quant)
    elif quant is not None:
        # From the same float weights, in the same groups: the values tmo-patch stores.
        round_experts(model, quant)
    return model


def round_experts(model: torch.nn.Module, spec: QuantSpec) -> None:
    """Round every transformers experts module's ``gate_up_proj`` and ``down_proj`` through
    ``spec``'s format in place, grouped along their inputs as the format groups them
    (inputs last, ``[E, N, K]``, as Qwen3-MoE, OLMoE and Mixtral store them; first,
    ``[E, K, N]``, as GPT-OSS does)."""
    hidden, rounded = model.config.hidden_size, 0
    for module in model.modules():
        gate_up, down = (getattr(module, name, None) for name in ("gate_up_proj", "down_proj"))
        if not all(isinstance(t, torch.Tensor) and t.dim() == 3 for t in (gate_up, down)):
            continue
        if gate_up.shape[1] == hidden != gate_up.shape[2]:
            inputs_first = True
        elif gate_up.shape[2] == hidden != gate_up.shape[1]:
            inputs_first = False
        else:
            raise ValueError(f"cannot tell the inputs' dimension of gate_up_proj "
                             f"{list(gate_up.shape)} at hidden size {hidden}")
        for tensor in (gate_up, down):
            w_ENK = tensor.data.transpose(1, 2) if inputs_first else tensor.data
            q, scale = quant.quantize_weights(w_ENK.contiguous(), spec)
            rounded_ENK = quant.dequantize_weights(q, scale, spec).to(tensor.dtype)
            tensor.data.copy_(rounded_ENK.transpose(1, 2) if inputs_first else rounded_ENK)
        rounded += 1
    if not rounded:
        raise ValueError(f"{type(model).__name__} has no experts module with 3-D gate_up_proj "
                         f"and down_proj to store in {spec.name}")


def quantize_patched_experts(model: torch.nn.Module, spec: QuantSpec) -> None:
    """Every patched block's experts stored in ``spec``'s format (`tmo.hf.QuantizedExperts`):
    the block then runs ``moe::experts_quant``."""
    for block in model.modules():
        if isinstance(block, HFMoEBlock):
            w13, w2, b13, b2 = block.expert_weights()
            (q13, s13), (q2, s2) = (quant.quantize_weights(w, spec) for w in (w13, w2))
            experts = QuantizedExperts(spec, q13, q2, s13, s2, b13, b2)
            block.use_experts(experts, quantized_weights(experts))


def compile_kwargs(way: str, mode: str | None, inner: str = "inductor") -> dict:
    """``torch.compile``'s ``backend`` and ``mode`` for ``way``: ours through
    `torch_moe_ops.backend` (which hands the graph to ``inner``), transformers'
    straight to ``inner``."""
    if way in ("tmo-patch", "hf+tmo-experts"):
        return {"backend": tmo.backend(mode=mode, inner=inner), "mode": None}
    return {"backend": inner, "mode": mode}


def compiler(way: str, mode: str | None) -> Callable[[Callable], Callable]:
    kwargs = compile_kwargs(way, mode)
    return lambda fn: torch.compile(fn, fullgraph=True, **kwargs)


def graph_replay_ms(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Ms per call of ``calls`` calls captured in one CUDA graph: the GPU's time for
    a call, gaps between its kernels included, without the per-call host cost
    (which at decode sizes exceeds a block's GPU time and is the same for every way)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return time_ms(graph.replay, replays, graphs=False) / calls


def time_ms(fn: Callable[[], object], iters: int, graphs: bool) -> float:
    """Mean ms per call over ``iters`` back-to-back calls (after 3 warm-up calls)."""
    for _ in range(3):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
               "cudaEventSynchronize")


def profile(fn: Callable[[], object], iters: int, graphs: bool, trace: str | None) -> dict:
    """GPU kernel ms per call and host syncs per call, from ``iters`` profiled calls."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            if graphs:
                torch.compiler.cudagraph_mark_step_begin()
            fn()
        torch.cuda.synchronize()
    if trace:
        prof.export_chrome_trace(trace)
    kernel_us = syncs = kernels = 0
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernel_us += event.device_time
            kernels += 1
        elif event.name.startswith(SYNC_EVENTS) and "Async" not in event.name:
            syncs += 1
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:12]
    return {"gpu_ms": kernel_us / 1e3 / iters, "syncs": syncs / iters,
            "kernels": kernels / iters,
            "top_cpu": [(e.key, round(e.self_cpu_time_total / iters, 1), e.count // iters)
                        for e in top]}


def bench_way(shape_name: str, way: str, rows, args) -> list[dict]:
    shape = SHAPES[shape_name]
    cfg = shape.config(args.layers)
    model = build(shape, way, args.layers)
    block = moe_blocks(model)[0]
    results = []
    for mode, phase_rows in (("reduce-overhead", [r for r in rows if r[1] == 1]),
                             (None, [r for r in rows if r[1] > 1])):
        torch._dynamo.reset()
        compile_fn = compiler(way, mode)
        forward = compile_fn(model)
        # The block alone is timed inside a CUDA graph of its own (decode) or
        # back to back (prefill): compiled without Inductor's CUDA graphs either way.
        moe_forward = compiler(way, None)(block)
        graphs = mode == "reduce-overhead"
        for batch, seq in phase_rows:
            if way == "hf-batched_mm" and not batched_mm_fits(cfg, batch * seq):
                continue
            ids_BS = torch.randint(3, cfg.vocab_size, (batch, seq), device="cuda")
            x_BSH = torch.randn(batch, seq, cfg.hidden_size, device="cuda",
                                dtype=torch.bfloat16)
            # Prefill rows: half the calls of decode rows, at least 20. A tenth (5
            # forwards of OLMoE 1x2048) read host noise as a gap between the ways.
            iters = args.iters if seq == 1 else max(20, args.iters // 2)
            with torch.inference_mode():
                def run(forward=forward, ids_BS=ids_BS):
                    return forward(input_ids=ids_BS, use_cache=False).logits

                ms = time_ms(run, iters, graphs)
                trace = (os.path.join(args.out, f"trace-{shape_name}-{way}-{batch}x{seq}.json")
                         if args.traces else None)
                prof = profile(run, min(iters, 10), graphs, trace)
                def run_moe(moe_forward=moe_forward, x_BSH=x_BSH):
                    return moe_forward(x_BSH)

                moe_ms = (graph_replay_ms(run_moe) if graphs
                          else time_ms(run_moe, iters, graphs=False))
            row = {"shape": shape_name, "way": way, "batch": batch, "seq": seq, "ms": ms,
                   "moe_ms": moe_ms, **prof}
            print(f"{shape_name:14s} {way:15s} {batch:4d}x{seq:<5d} {ms:8.3f} ms  "
                  f"gpu {prof['gpu_ms']:7.3f}  moe {moe_ms:7.3f}  syncs {prof['syncs']:.1f}  "
                  f"kernels {prof['kernels']:.0f}", flush=True)
            if args.traces:
                print("    top host ops (us, calls per forward):", prof["top_cpu"], flush=True)
            results.append(row)
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    return results


def table(rows: list[dict]) -> str:
    """Markdown: per shape and row, ms per forward of each way, our best against
    the best transformers way, and the MoE block alone likewise."""
    lines = ["| shape | B x S | " + " | ".join(WAYS) + " | patch vs best HF | "
             "MoE block: patch / best HF (ms) | MoE speedup |",
             "|---|---|" + "---|" * (len(WAYS) + 3)]
    keys = sorted({(r["shape"], r["batch"], r["seq"]) for r in rows},
                  key=lambda k: (k[0], k[2], k[1]))
    for shape, batch, seq in keys:
        by_way = {r["way"]: r for r in rows
                  if (r["shape"], r["batch"], r["seq"]) == (shape, batch, seq)}
        cells = [f"{by_way[w]['ms']:.3f}" if w in by_way else "-" for w in WAYS]
        hf = [by_way[w] for w in ("hf-grouped_mm", "hf-batched_mm") if w in by_way]
        ours = by_way.get("tmo-patch")
        if hf and ours:
            best_hf = min(hf, key=lambda r: r["ms"])
            best_hf_moe = min(r["moe_ms"] for r in hf)
            speed = f"{best_hf['ms'] / ours['ms']:.2f}x"
            moe = f"{ours['moe_ms']:.3f} / {best_hf_moe:.3f}"
            moe_speed = f"{best_hf_moe / ours['moe_ms']:.2f}x"
        else:
            speed = moe = moe_speed = "-"
        lines.append(f"| {shape} | {batch}x{seq} | " + " | ".join(cells)
                     + f" | {speed} | {moe} | {moe_speed} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="qwen3-30b-a3b",
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--decode", default=",".join(map(str, DECODE_BATCHES)),
                        help="batch sizes of the S=1 rows ('' for none)")
    parser.add_argument("--prefill", default=",".join(f"{b}x{s}" for b, s in PREFILL),
                        help="BxS of the prefill rows ('' for none)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--iters", type=int, default=50,
                        help="timed calls per decode row (prefill rows: half, at least 20)")
    parser.add_argument("--traces", action="store_true", help="write chrome traces to --out")
    parser.add_argument("--out", default="results")
    parser.add_argument("--table-from", nargs="+", metavar="JSON",
                        help="print the table of earlier runs' model.json files and exit")
    args = parser.parse_args()
    if args.table_from:
        rows = []
        for path in args.table_from:
            with open(path) as f:
                rows += json.load(f)
        print(table(rows))
        return
    os.makedirs(args.out, exist_ok=True)
    decode = tuple(int(b) for b in args.decode.split(",") if b)
    prefill = tuple(tuple(int(v) for v in p.split("x")) for p in args.prefill.split(",") if p)
    rows = rows_of(decode, prefill)
    results = []
    for shape_name in args.shapes.split(","):
        for way in args.ways.split(","):
            results += bench_way(shape_name, way, rows, args)
            with open(os.path.join(args.out, "model.json"), "w") as f:
                json.dump(results, f, indent=1)
    meta = (f"{torch.cuda.get_device_name()}, {datetime.date.today()}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, layers "
            + ", ".join(f"{s}: {args.layers or SHAPES[s].layers}" for s in args.shapes.split(",")))
    text = meta + "\n\n" + table(results)
    with open(os.path.join(args.out, "model.md"), "w") as f:
        f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
