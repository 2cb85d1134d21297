"""Tune the fused-MoE kernel configs for one layer shape on the local GPU.

Legend: E experts, N expert intermediate size (I), K hidden size (H), M tokens.

    python -m torch_moe_ops.backends.triton.tune --experts 128 --inter 768 \\
        --hidden 2048 --top-k 8 --dtype bfloat16 [--tokens 1 16 256 4096] [--out DIR]

For each token count it times `fused_experts` replayed from a CUDA graph
(median of `triton.testing.do_bench`) with every candidate config on random routing and
writes the fastest into ``E=..,N=..,K=..,dtype=..,device=...json`` (the file
`configs.get_config` reads). Only for machines with a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import pathlib
from unittest import mock

import torch
import triton.testing

from torch_moe_ops.backends.triton import configs, fused

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def candidates(rows_per_expert: float):
    """Configs worth timing: BLOCK_M near the expected rows per expert. Short
    tiles get narrow, deep options, which give decode more programs per weight byte."""
    block_ms = [m for m in (16, 32, 64, 128) if m <= max(16, 2 * rows_per_expert)]
    for block_m in block_ms[-2:]:
        short = block_m <= 32
        for block_n, block_k, num_warps, num_stages in itertools.product(
                (32, 64, 128) if short else (64, 128, 256), (64, 128, 256) if short else (64, 128),
                (4, 8), (3, 4, 5) if short else (3, 4)):
            yield configs.KernelConfig(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                                       GROUP_M=1 if block_m == 16 else 8, num_warps=num_warps,
                                       num_stages=num_stages)


def time_config(config, args) -> float:
    """Milliseconds per call, replayed from a CUDA graph: eager timing of small
    token counts would measure Python launch overhead, not the kernels."""
    with mock.patch.object(fused, "get_config", lambda *_: config):
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                fused.fused_experts(*args)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fused.fused_experts(*args)
        except triton.runtime.errors.OutOfResources:
            return float("inf")
    return triton.testing.do_bench(graph.replay, warmup=5, rep=20)


def tune(E: int, N: int, K: int, top_k: int, dtype: torch.dtype, tokens, out_dir):
    device = torch.device("cuda")
    w13_EFH = torch.randn(E, 2 * N, K, device=device, dtype=dtype) / K ** 0.5
    w2_EHI = torch.randn(E, K, N, device=device, dtype=dtype) / N ** 0.5
    table = {}
    for M in tokens:
        hidden_TH = torch.randn(M, K, device=device, dtype=dtype)
        logits_TE = torch.randn(M, E, device=device)
        topk_weights_TK, topk_ids_TK = torch.topk(logits_TE.softmax(-1), top_k, dim=-1)
        args = (hidden_TH, topk_weights_TK, topk_ids_TK.to(torch.int32), w13_EFH, w2_EHI, None,
                None, "silu", 1.702, 7.0)
        timed = [(time_config(c, args), c) for c in candidates(M * top_k / E)]
        best_ms, best = min(timed, key=lambda pair: pair[0])
        table[str(M)] = dataclasses.asdict(best)
        print(f"M={M}: {best_ms * 1e3:.1f} us {best}", flush=True)
    name = configs.config_file_name(E, N, K, dtype, configs.device_name(device))
    path = pathlib.Path(out_dir) / name
    path.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, required=True)
    parser.add_argument("--inter", type=int, required=True)
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--top-k", type=int, required=True)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--tokens", type=int, nargs="+", default=DEFAULT_TOKENS)
    parser.add_argument("--out", default=str(configs.CONFIG_DIR))
    a = parser.parse_args()
    tune(a.experts, a.inter, a.hidden, a.top_k, getattr(torch, a.dtype), a.tokens, a.out)


if __name__ == "__main__":
    main()
