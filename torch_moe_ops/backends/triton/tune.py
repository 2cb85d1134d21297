"""Tune the fused-MoE kernel configs for one layer shape on the local GPU.

Legend: E experts, N expert intermediate size (I), K hidden size (H), M tokens.

    python -m torch_moe_ops.backends.triton.tune --experts 128 --inter 768 \\
        --hidden 2048 --top-k 8 --dtype bfloat16 [--tokens 1 16 256 4096] [--out DIR] \\
        [--quant fp8_block [--quant-activations fp8_group] [--block-size 128 128]]

For each token count it times `fused_experts` replayed from a CUDA graph
(median of `triton.testing.do_bench`) on random routing with every candidate:
the direct kernels where experts get about one slot each, the tiled kernels,
and ``torch._grouped_mm`` where it can run. The fastest goes into
``E=..,N=..,K=..,dtype=..,device=...json`` (the file `configs.get_config`
reads); a ``grouped_mm`` entry keeps the best tiles for when it cannot run.
With ``--quant`` the weights are random ones quantized to that `QuantSpec`,
the candidates those whose K tiles suit it, and the file's name carries the
format (``...,quant=fp8_block128x128+fp8_group,...``). Entries of token counts
not tuned in this run are kept from the file already there (or the shipped one).
Only for machines with a CUDA GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import pathlib

import torch
import triton.testing

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels import grouped_gemm
from torch_moe_ops.backends.registry import Problem
from torch_moe_ops.backends.triton import configs, fused
from torch_moe_ops.config import QUANT_WEIGHT_FORMATS, QuantSpec

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def direct_candidates(spec: QuantSpec | None = None):
    """Narrow, deep tiles: a program streams a [BLOCK_N, H] slice of one expert.
    w8a8 multiplies on the tensor cores, whose tiles are 16 columns and more; MXFP4
    also tries the tensor cores' wide tiles (`direct_kernels.MXFP4_DOT_MIN_N`)."""
    if spec is not None and spec.activations != "none":
        shapes = itertools.product((16, 32, 64, 128), (128, 256), (4, 8), (3, 4))
    else:
        shapes = itertools.product((1, 2, 4, 8, 16, 32), (128, 256, 512), (2, 4, 8), (3,))
        if spec is not None and spec.weights == "mxfp4":
            # 64 deep too: one block of fragments, the tiled kernels' best depth.
            shapes = itertools.chain(shapes, itertools.product((64, 128), (64, 128, 256),
                                                               (4, 8), (3, 4)))
    # Each with K in parts too: a token's few slots give wide tiles too few programs.
    for (block_n, block_k, num_warps, num_stages), split_k in itertools.product(shapes,
                                                                                (1, 2, 4, 8)):
        yield configs.KernelConfig(BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=1,
                                   num_warps=num_warps, num_stages=num_stages, path="direct",
                                   SPLIT_K=split_k)


def tiled_candidates(slots_per_expert: float, spec: QuantSpec | None = None):
    """BLOCK_M near the expected slots per expert: few rows waste most of a tall tile.

    fp8 x fp8 tiles (w8a8) take half the shared memory of bf16 ones per element,
    so they also try twice as deep (short tiles) or twice as wide (tall ones), and
    more stages in flight; MXFP4 weights take a quarter of bf16's and try deeper
    tiles too."""
    w8a8 = spec is not None and spec.activations != "none"
    mxfp4 = spec is not None and spec.weights == "mxfp4"
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * slots_per_expert)]
    for block_m in block_ms[-2:]:
        short = block_m <= 32
        if w8a8:
            shapes = itertools.product((32, 64, 128) if short else (128, 256),
                                       (128, 256) if short else (128,), (4, 8), (3, 4, 5))
        else:
            # MXFP4 tiles are decoded as the left operand: up to 256 weight rows.
            widths = (32, 64, 128, 256) if mxfp4 else (32, 64, 128)
            shapes = itertools.product(widths if short else (64, 128),
                                       (64, 128, 256) if mxfp4 else (64, 128), (4, 8), (3, 4))
        for block_n, block_k, num_warps, num_stages in shapes:
            yield configs.KernelConfig(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                       GROUP_M=1 if block_m == 16 else 8, num_warps=num_warps,
                                       num_stages=num_stages, path="tiled")


def run_config(config, args, spec: QuantSpec | None):
    """One call of the experts on ``config``'s kernels: ``args`` are those of
    ``moe::experts``, or of ``moe::experts_quant`` with quantized weights (``spec``)."""
    if spec is None:
        return fused.experts_with_config(config, *args)
    return fused.experts_quant_with_config(config, *args)


def precompile(candidates, args, spec: QuantSpec | None, threads: int = 16) -> None:
    """Compile every candidate's kernels for these sizes before any is timed.

    Compiling dominates a tuning run and runs largely outside the GIL (ptxas is a
    subprocess), so threads overlap it. Failures are left for `time_config`,
    which runs each candidate again on its own."""
    def run_once(config):
        try:
            run_config(config, args, spec)
        except Exception:  # noqa: BLE001, S110 (reported when the candidate is timed)
            pass

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(run_once, candidates))
    torch.cuda.synchronize()


def time_config(config, args, spec: QuantSpec | None = None) -> float:
    """Milliseconds per call, replayed from a CUDA graph: eager timing of small
    token counts would measure Python launch overhead, not the kernels."""
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run_config(config, args, spec)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run_config(config, args, spec)
    except triton.runtime.errors.OutOfResources:
        return float("inf")
    return triton.testing.do_bench(graph.replay, warmup=5, rep=15)


def tune_token_count(M: int, top_k: int, args, grouped_mm_runs: bool,
                     spec: QuantSpec | None = None):
    """The fastest config for M tokens and its time in ms."""
    E = args[3].shape[0]
    slots_per_expert = M * top_k / E
    candidates = list(tiled_candidates(slots_per_expert, spec))
    if slots_per_expert <= 1:
        candidates += direct_candidates(spec)
    candidates = [c for c in candidates if configs.fits_format(c, spec)]
    precompile(candidates, args, spec)
    timed = [(time_config(c, args, spec), c) for c in candidates]
    best_ms, best = min(timed, key=lambda pair: pair[0])
    for path in sorted({c.path for _, c in timed}):
        print(f"  M={M} best {path}: "
              f"{min(ms for ms, c in timed if c.path == path) * 1e3:.1f} us", flush=True)
    if grouped_mm_runs and slots_per_expert >= 8:
        # Its tiles are those of the best tiled config, for where grouped_mm cannot run.
        _, tiled = min((pair for pair in timed if pair[1].path == "tiled"),
                       key=lambda pair: pair[0])
        grouped = dataclasses.replace(tiled, path="grouped_mm")
        grouped_ms = time_config(grouped, args, spec)
        if grouped_ms < best_ms:
            best_ms, best = grouped_ms, grouped
    return best_ms, best


def file_entry(config: configs.KernelConfig) -> dict:
    """``config`` as a config file holds it: fields at their defaults are left out."""
    return {field.name: getattr(config, field.name) for field in dataclasses.fields(config)
            if field.default is dataclasses.MISSING or getattr(config, field.name) != field.default}


def tune(E: int, N: int, K: int, top_k: int, dtype: torch.dtype, tokens, out_dir,
         spec: QuantSpec | None = None):
    device = torch.device("cuda")
    w13_EFH = torch.randn(E, 2 * N, K, device=device, dtype=dtype) / K ** 0.5
    w2_EHI = torch.randn(E, K, N, device=device, dtype=dtype) / N ** 0.5
    if spec is None:
        weights = (w13_EFH, w2_EHI, None, None)
    else:
        (w13, w13_scale), (w2, w2_scale) = (quant.quantize_weights(w, spec)
                                            for w in (w13_EFH, w2_EHI))
        weights = (w13, w2, w13_scale, w2_scale, None, None, spec.weights, spec.activations,
                   spec.block_list)
    grouped_mm_runs = (spec is None
                       and grouped_gemm.supports(None, Problem(dtype), device) is None
                       and grouped_gemm.aligned(K, N))
    table = {}
    for M in tokens:
        hidden_TH = torch.randn(M, K, device=device, dtype=dtype)
        logits_TE = torch.randn(M, E, device=device)
        topk_weights_TK, topk_ids_TK = torch.topk(logits_TE.softmax(-1), top_k, dim=-1)
        args = (hidden_TH, topk_weights_TK, topk_ids_TK.to(torch.int32), *weights, "silu",
                1.702, 7.0)
        best_ms, best = tune_token_count(M, top_k, args, grouped_mm_runs, spec)
        table[str(M)] = file_entry(best)
        print(f"M={M}: {best_ms * 1e3:.1f} us {best}", flush=True)
    name = configs.config_file_name(E, N, K, dtype, configs.device_name(device), spec)
    path = pathlib.Path(out_dir) / name
    # Token counts not tuned now keep their entries: of the file being written
    # if there is one, else of the shipped one.
    kept = configs.load_config_file(path) or configs.load_config_file(configs.CONFIG_DIR / name)
    table = {**{str(M): file_entry(c) for M, c in kept or ()}, **table}
    table = dict(sorted(table.items(), key=lambda item: int(item[0])))
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m torch_moe_ops.tune",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--inter", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument("--out", default=str(configs.CONFIG_DIR))
    parser.add_argument("--quant", choices=tuple(QUANT_WEIGHT_FORMATS),
                        help="quantized weights of this format (QuantSpec.weights)")
    parser.add_argument("--quant-activations", help="QuantSpec.activations (the format's "
                        "default without)")
    parser.add_argument("--block-size", type=int, nargs=2, help="QuantSpec.block_size of "
                        "fp8_block (128 128 without)")
    a = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU: it times the Triton kernels on the GPU at hand and "
                     "writes their configs for it (this torch sees no CUDA device); run it "
                     "on the machine that will run the model")
    spec = None
    if a.quant is not None:
        spec = QuantSpec(a.quant, a.quant_activations,
                         tuple(a.block_size) if a.block_size else None)
    tune(a.experts, a.inter, a.hidden, a.top_k, getattr(torch, a.dtype), a.tokens, a.out, spec)


if __name__ == "__main__":
    main()
