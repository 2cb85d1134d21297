"""vLLM's Triton fused-MoE kernel as a peer of bench_experts.py, loaded from a local copy.

vLLM's code is not part of this repository: it is read at run time from a folder that
git ignores, ``<repo>/.peers/vllm`` or ``$TMO_VLLM_SRC``, laid out as vLLM's own tree
(so a vLLM checkout works as well):

    vllm/model_executor/layers/fused_moe/fused_moe.py      the kernel
    vllm/model_executor/layers/fused_moe/configs/*.json    tuned tiles per shape and GPU

One way to fill it, from vLLM's wheel (about 340 MB, of which about 1.3 MB is kept):

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm
    unzip /tmp/vllm/vllm-0.33.0-*.whl -d .peers/vllm \\
        'vllm/model_executor/layers/fused_moe/fused_moe.py' \\
        'vllm/model_executor/layers/fused_moe/configs/*.json'

The ``vllm`` package itself is not imported (it needs its compiled CUDA ops): the
``@triton.jit`` functions the kernel needs are cut out of the file with ``ast``. The host
side is redone here as vLLM's ``fused_experts`` runs for bf16 weights without
quantization or expert parallelism, with its CUDA ops swapped for equivalents:
``moe_align_block_size`` for our ``align_rows`` (same layout: slots grouped by expert,
each group padded to whole blocks with the sentinel ``T * K``), ``silu_and_mul`` and
``moe_sum`` for torch. Without the folder, ``vllm_peers`` returns no peer.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from torch_moe_ops.backends.triton.align import align_rows

KERNEL = "fused_moe_kernel"
FUSED_MOE_DIR = os.path.join("vllm", "model_executor", "layers", "fused_moe")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPUTE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                 torch.float32: tl.float32}


def source_root() -> str:
    return os.environ.get("TMO_VLLM_SRC") or os.path.join(REPO, ".peers", "vllm")


def kernel_file() -> str | None:
    """Path of vLLM's ``fused_moe.py`` under ``source_root()``, None when there is none."""
    path = os.path.join(source_root(), FUSED_MOE_DIR, "fused_moe.py")
    return path if os.path.isfile(path) else None


def source_version() -> str | None:
    """What the peer runs, for a results header: the first line of the folder's
    ``SOURCE`` note, or None without a kernel file."""
    if kernel_file() is None:
        return None
    note = os.path.join(source_root(), "SOURCE")
    if not os.path.isfile(note):
        return "vLLM source without a SOURCE note"
    with open(note) as f:
        return f.readline().strip()


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) == "triton.jit"


@functools.cache
def load_kernel(path: str) -> triton.JITFunction:
    """``fused_moe_kernel`` from ``path`` with the jit functions it calls, transitively."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    jitted = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
              and any(map(_is_triton_jit, node.decorator_list))}
    if KERNEL not in jitted:
        raise RuntimeError(f"no @triton.jit {KERNEL} in {path}")
    wanted, pending = {}, [KERNEL]
    while pending:
        name = pending.pop()
        if name in wanted or name not in jitted:
            continue
        wanted[name] = jitted[name]
        pending += [call.func.id for call in ast.walk(jitted[name])
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)]
    module = ast.Module(body=sorted(wanted.values(), key=lambda n: n.lineno), type_ignores=[])
    # Compiled under the file's own name and line numbers: triton.jit reads each
    # function's source back from the file.
    # A module name, too: Triton's code generator reads each callee's __module__.
    namespace = {"__name__": "vllm_fused_moe_peer", "triton": triton, "tl": tl, "torch": torch}
    exec(compile(module, path, "exec"), namespace)  # noqa: S102  (the peer's own kernel source)
    return namespace[KERNEL]


def device_file_name() -> str:
    """The GPU's name as vLLM spells it in config file names."""
    name = re.sub(r"[\s/]+", "_", torch.cuda.get_device_name())
    # vLLM files every H200 variant (NVL, ...) under the one name.
    return "NVIDIA_H200" if "H200" in name.split("_") else name


@functools.cache
def tuned_configs(root: str, num_experts: int, inter: int,
                  device: str) -> dict[int, dict] | None:
    """vLLM's tuned configs for bf16/fp16 experts of this shape on ``device``, by token count."""
    path = os.path.join(root, FUSED_MOE_DIR, "configs",
                        f"E={num_experts},N={inter},device_name={device}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        table = json.load(f)
    # Keys are token counts; a file may also carry its "triton_version".
    return {int(key): config for key, config in table.items() if key.isdigit()}


def default_config(num_tokens: int, num_experts: int) -> dict:
    """The tiles vLLM (0.33) falls back to for unquantized experts with no tuned file.

    Few tokens are memory bound: short M tiles, long K tiles, deep pipelines. Many
    are compute bound: wide M and N tiles and more warps; M blocks are grouped for
    L2 reuse only when each expert sees enough tokens for several of them.
    """
    T = num_tokens
    block_m = 16 if T <= 32 else 32 if T <= 96 else 64 if T <= 512 else 128
    few = T <= 64
    return {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": 64 if few else 128,
            "BLOCK_SIZE_K": 128 if few else 64,
            "GROUP_SIZE_M": 16 if T // num_experts > 128 else 1,
            "num_warps": 4 if T <= 128 else 8, "num_stages": 4 if T <= 32 else 3}


def pick_config(num_tokens: int, num_experts: int, inter: int) -> dict:
    """As vLLM: the tuned entry of the nearest token count, else the default rule."""
    device = device_file_name() if torch.cuda.is_available() else ""
    table = tuned_configs(source_root(), num_experts, inter, device)
    if table is None:
        return default_config(num_tokens, num_experts)
    return table[min(table, key=lambda tokens: abs(tokens - num_tokens))]


def _gemm(kernel, a_RK, b_ENK, c_SN, topk_weights_TK, sorted_ids, block_expert, num_padded,
          num_rows, top_k, routed_weight, config):
    """One launch of vLLM's kernel: ``c[s] = a[s // top_k] @ b[expert(s)].T`` per routed slot."""
    grid = (triton.cdiv(num_rows, config["BLOCK_SIZE_M"])
            * triton.cdiv(b_ENK.shape[1], config["BLOCK_SIZE_N"]),)
    kernel[grid](
        a_ptr=a_RK, b_ptr=b_ENK, c_ptr=c_SN, b_bias_ptr=None, a_scale_ptr=None,
        b_scale_ptr=None, topk_weights_ptr=topk_weights_TK, sorted_token_ids_ptr=sorted_ids,
        expert_ids_ptr=block_expert, num_tokens_post_padded_ptr=num_padded,
        N=b_ENK.shape[1], K=b_ENK.shape[2], EM=num_rows, num_valid_tokens=c_SN.shape[0],
        stride_am=a_RK.stride(0), stride_ak=a_RK.stride(1), stride_be=b_ENK.stride(0),
        stride_bk=b_ENK.stride(2), stride_bn=b_ENK.stride(1), stride_cm=c_SN.stride(0),
        stride_cn=c_SN.stride(1), stride_asm=0, stride_ask=0, stride_bse=0, stride_bsk=0,
        stride_bsn=0, stride_bbe=0, stride_bbn=0, group_n=0, group_k=0,
        naive_block_assignment=sorted_ids is None, SPLIT_K=1, MUL_ROUTED_WEIGHT=routed_weight,
        top_k=top_k, compute_type=COMPUTE_TYPES[a_RK.dtype], use_fp8_w8a8=False,
        use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False, HAS_BIAS=False,
        SWAP_AB=False, **config)


def vllm_peers(shape, num_tokens: int, problem) -> dict[str, Callable[[], torch.Tensor]]:
    """``{"vllm-triton": fn}`` on the bench's problem, or {} without the source or for a
    shape it does not cover here (biases or an activation other than silu: vLLM runs
    those activations as CUDA ops, and their torch spelling would time torch, not vLLM).

    No host sync: every size is known before the call, so ``fn`` can be graph-captured.
    """
    path = kernel_file()
    if path is None or shape.activation != "silu" or shape.bias:
        return {}
    kernel = load_kernel(path)
    hidden_TH, topk_weights_TK, topk_ids_TK, w13_EFH, w2_EHI, _, _ = problem
    T, K = topk_ids_TK.shape
    E, H, I = w2_EHI.shape
    S = T * K
    config = pick_config(T, E, I)
    block_m = config["BLOCK_SIZE_M"]
    # vLLM's decode path: with at least 4 experts per routed slot it skips the sort and
    # gives every slot a block of its own, its expert read straight from topk_ids.
    block_per_slot = S * 4 <= E

    def run() -> torch.Tensor:
        if block_per_slot:
            sorted_ids, block_expert = None, topk_ids_TK.view(-1)
            num_padded = torch.full((1,), S * block_m, dtype=torch.int32,
                                    device=hidden_TH.device)
            num_rows = S * block_m
        else:
            # Its capacity is at most S blocks already: the bound vLLM puts on its grid.
            sorted_ids, block_expert, num_padded = align_rows(topk_ids_TK, E, block_m)
            num_rows = sorted_ids.numel()
        args = (topk_weights_TK, sorted_ids, block_expert, num_padded, num_rows)
        gate_up_SF = hidden_TH.new_empty(S, 2 * I)
        _gemm(kernel, hidden_TH, w13_EFH, gate_up_SF, *args, K, False, config)
        act_SI = F.silu(gate_up_SF[:, :I]) * gate_up_SF[:, I:]
        down_SH = hidden_TH.new_empty(S, H)
        _gemm(kernel, act_SI, w2_EHI, down_SH, *args, 1, True, config)
        return down_SH.view(T, K, H).sum(dim=1)

    return {"vllm-triton": run}
