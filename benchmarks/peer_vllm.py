"""vLLM's Triton fused-MoE kernel as a peer of bench_experts.py, loaded from a local copy.

Legend: T tokens, K experts per token, S = T * K routed slots, E experts,
H hidden size, I expert intermediate size, F = 2 * I.

vLLM's code is not part of this repository: it is read at run time from a folder that
git ignores, ``<repo>/.peers/vllm`` or ``$TMO_VLLM_SRC``, laid out as vLLM's own tree
(so a vLLM checkout works as well):

    vllm/model_executor/layers/fused_moe/fused_moe.py              the kernel
    vllm/model_executor/layers/fused_moe/configs/*.json            tuned tiles per shape and GPU
    vllm/model_executor/layers/quantization/utils/fp8_utils.py     fp8 activation quantizer

One way to fill it, from vLLM's wheel (about 340 MB, of which about 1.8 MB is kept):

    pip download vllm==0.33.0 --no-deps -d /tmp/vllm
    unzip /tmp/vllm/vllm-0.33.0-*.whl -d .peers/vllm \\
        'vllm/model_executor/layers/fused_moe/fused_moe.py' \\
        'vllm/model_executor/layers/fused_moe/configs/*.json' \\
        'vllm/model_executor/layers/quantization/utils/fp8_utils.py'
    echo "vLLM 0.33.0 from PyPI wheel" > .peers/vllm/SOURCE

The ``vllm`` package itself is not imported (it needs its compiled CUDA ops): the
``@triton.jit`` functions the kernels need are cut out of the files with ``ast``. The
host side is redone here as vLLM's ``fused_experts`` runs without expert parallelism,
with its CUDA ops swapped for equivalents: ``moe_align_block_size`` for our
``align_rows`` (same layout: slots grouped by expert, each group padded to whole
blocks with the sentinel ``S``), ``silu_and_mul`` and ``moe_sum`` for torch.

Weight formats (each a `QuantSpec` of ours; the peer reads our quantized weights
as they are, the layout vLLM loads checkpoints into):

- bf16: the kernel without quantization.
- ``fp8_block`` 128 x 128 with ``fp8_group`` activations: ``use_fp8_w8a8`` with
  ``block_shape=[128, 128]``, activations quantized per token and 128 columns by
  vLLM's ``_per_token_group_quant_fp8`` Triton kernel (its fallback where its CUDA
  ``per_token_group_fp8_quant`` is not built: the same arithmetic).
- ``fp8_channel`` with ``fp8_token`` activations: ``use_fp8_w8a8`` with
  ``per_channel_quant`` (vLLM's per-channel weights, per-token activations);
  activations quantized per token by the same Triton kernel with one group per row,
  in place of vLLM's CUDA ``scaled_fp8_quant(use_per_token_if_dynamic=True)``.

Other formats (fp8 per tensor with per-token activations, MXFP4), biases and
activations other than silu have no peer here. Without the folder, ``vllm_peers``
returns no peer.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import os
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.align import align_rows
from torch_moe_ops.config import QuantSpec

KERNEL = "fused_moe_kernel"
GROUP_QUANT_KERNEL = "_per_token_group_quant_fp8"
FUSED_MOE_DIR = os.path.join("vllm", "model_executor", "layers", "fused_moe")
FP8_UTILS = os.path.join("vllm", "model_executor", "layers", "quantization", "utils",
                         "fp8_utils.py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPUTE_TYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
                 torch.float32: tl.float32}
# vLLM's ``per_token_group_quant_fp8`` default: the smallest group maximum.
GROUP_QUANT_EPS = 1e-10


@dataclasses.dataclass(frozen=True)
class Mode:
    """How vLLM's ``fused_experts`` runs one weight format: the kernel's flags and
    the name of its tuned config files."""

    fp8: bool = False
    block_shape: tuple[int, int] | None = None
    per_channel: bool = False

    @property
    def config_suffix(self) -> str:
        """What vLLM adds to a config file's name: ``,dtype=fp8_w8a8[,block_shape=[n,k]]``."""
        if not self.fp8:
            return ""
        block = "" if self.block_shape is None else ",block_shape=[{},{}]".format(
            *self.block_shape)
        return ",dtype=fp8_w8a8" + block


def mode_of(spec: QuantSpec | None) -> Mode | str:
    """vLLM's mode for weights in ``spec`` (None: bf16), or why it has none here."""
    if spec is None:
        return Mode()
    if spec.weights == "fp8_block" and spec.activations == "fp8_group":
        return Mode(fp8=True, block_shape=spec.block_size)
    if spec.weights == "fp8_channel" and spec.activations == "fp8_token":
        return Mode(fp8=True, per_channel=True)
    return (f"vLLM's Triton fused-MoE kernel has no {spec.name} mode (its fp8 modes: "
            f"128x128 blocks with per-group activations, per-channel with per-token)")


def source_root() -> str:
    return os.environ.get("TMO_VLLM_SRC") or os.path.join(REPO, ".peers", "vllm")


def shown_path(path: str) -> str:
    """``path`` as results show it: relative to the checkout where it lies in it
    (results name no machine's paths)."""
    return os.path.relpath(path, REPO) if path.startswith(REPO + os.sep) else path


def shown_source_root() -> str:
    return shown_path(source_root())


def source_note(root: str) -> str | None:
    """The first line of the ``SOURCE`` note in a peer's folder ``root``, None without one."""
    note = os.path.join(root, "SOURCE")
    if not os.path.isfile(note):
        return None
    with open(note) as f:
        return f.readline().strip()


def kernel_file() -> str | None:
    """Path of vLLM's ``fused_moe.py`` under ``source_root()``, None when there is none."""
    path = os.path.join(source_root(), FUSED_MOE_DIR, "fused_moe.py")
    return path if os.path.isfile(path) else None


def source_version() -> str | None:
    """What the peer runs, for a results header: the first line of the folder's
    ``SOURCE`` note, or None without a kernel file."""
    if kernel_file() is None:
        return None
    return source_note(source_root()) or "vLLM source without a SOURCE note"


def why_not(shape, spec: QuantSpec | None, device: torch.device) -> str | None:
    """Why the peer does not run ``shape`` in ``spec``'s format on ``device``, or None."""
    mode = mode_of(spec)
    if isinstance(mode, str):
        return mode
    if kernel_file() is None:
        return f"no vLLM source at {shown_source_root()} (see benchmarks/peer_vllm.py)"
    if mode.fp8 and not os.path.isfile(os.path.join(source_root(), FP8_UTILS)):
        return f"no {FP8_UTILS} under {shown_source_root()}: its fp8 modes need it"
    if shape.activation != "silu" or shape.bias:
        # vLLM runs the other activations as CUDA ops: their torch spelling would time torch.
        return "vLLM's kernel is run here for silu without biases only"
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        return "Triton kernels run on the CPU only under TRITON_INTERPRET=1"
    return None


def _is_triton_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return ast.unparse(target) == "triton.jit"


@functools.cache
def load_jit(path: str, name: str) -> triton.JITFunction:
    """The ``@triton.jit`` function ``name`` of ``path`` with the jit functions it
    calls, transitively."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    jitted = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
              and any(map(_is_triton_jit, node.decorator_list))}
    if name not in jitted:
        raise RuntimeError(f"no @triton.jit {name} in {path}")
    wanted, pending = {}, [name]
    while pending:
        callee = pending.pop()
        if callee in wanted or callee not in jitted:
            continue
        wanted[callee] = jitted[callee]
        pending += [call.func.id for call in ast.walk(jitted[callee])
                    if isinstance(call, ast.Call) and isinstance(call.func, ast.Name)]
    module = ast.Module(body=sorted(wanted.values(), key=lambda n: n.lineno), type_ignores=[])
    # Compiled under the file's own name and line numbers: triton.jit reads each
    # function's source back from the file.
    # A module name, too: Triton's code generator reads each callee's __module__.
    namespace = {"__name__": f"vllm_peer_{name}", "triton": triton, "tl": tl, "torch": torch}
    exec(compile(module, path, "exec"), namespace)  # noqa: S102  (the peer's own kernel source)
    return namespace[name]


def device_file_name() -> str:
    """The GPU's name as vLLM spells it in config file names."""
    name = re.sub(r"[\s/]+", "_", torch.cuda.get_device_name())
    # vLLM files every H200 variant (NVL, ...) under the one name.
    return "NVIDIA_H200" if "H200" in name.split("_") else name


@functools.cache
def tuned_configs(root: str, num_experts: int, inter: int, device: str,
                  suffix: str) -> dict[int, dict] | None:
    """vLLM's tuned configs for experts of this shape on ``device``, by token count;
    ``suffix`` names the weight format as `Mode.config_suffix` does."""
    path = os.path.join(root, FUSED_MOE_DIR, "configs",
                        f"E={num_experts},N={inter},device_name={device}{suffix}.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        table = json.load(f)
    # Keys are token counts; a file may also carry its "triton_version".
    return {int(key): config for key, config in table.items() if key.isdigit()}


def default_config(num_tokens: int, num_experts: int, mode: Mode = Mode()) -> dict:
    """The tiles vLLM (0.33) falls back to with no tuned file, on CUDA.

    Few tokens are memory bound: short M tiles, long K tiles, deep pipelines. Many
    are compute bound: wide M and N tiles and more warps; M blocks are grouped for
    L2 reuse only when each expert sees enough tokens for several of them. fp8
    elements are half as wide, so fp8 keeps the long K tiles throughout. With
    block scales the tiles follow the blocks: N is the block's rows (64 for at
    most 8 tokens, twice the programs), K its columns.
    """
    T = num_tokens
    if mode.block_shape is not None:
        block_rows, block_cols = mode.block_shape
        narrow = T <= 8 and block_rows % 64 == 0
        return {"BLOCK_SIZE_M": 16 if T <= 64 else 64,
                "BLOCK_SIZE_N": 64 if narrow else block_rows, "BLOCK_SIZE_K": block_cols,
                "GROUP_SIZE_M": 1 if T <= 16 else 32, "num_warps": 4,
                "num_stages": (4 if T <= 4 else 3) if narrow else 3}
    block_m = 16 if T <= 32 else 32 if T <= 96 else 64 if T <= 512 else 128
    few = T <= 64
    return {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": 64 if few else 128,
            "BLOCK_SIZE_K": 128 if few or mode.fp8 else 64,
            "GROUP_SIZE_M": 16 if T // num_experts > 128 else 1,
            "num_warps": 4 if T <= 128 else 8, "num_stages": 4 if T <= 32 else 3}


def pick_config(num_tokens: int, num_experts: int, inter: int, mode: Mode = Mode()) -> dict:
    """As vLLM: the tuned entry of the nearest token count, else the default rule."""
    device = device_file_name() if torch.cuda.is_available() else ""
    table = tuned_configs(source_root(), num_experts, inter, device, mode.config_suffix)
    if table is None:
        return default_config(num_tokens, num_experts, mode)
    return table[min(table, key=lambda tokens: abs(tokens - num_tokens))]


def _swap_ab(mode: Mode, config: dict) -> bool:
    """vLLM's ``enable_swap_ab``: fp8 on sm90 with short M and wide N tiles
    computes the transposed product."""
    return (mode.fp8 and torch.cuda.is_available()
            and torch.cuda.get_device_capability() == (9, 0)
            and config["BLOCK_SIZE_M"] < 64 and config["BLOCK_SIZE_N"] >= 64)


def quantize_groups(x_MK: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] fp8, scale [M, K / group] fp32)``: vLLM's ``_per_token_group_quant_fp8``
    kernel, one program per row and group of ``group`` columns."""
    kernel = load_jit(os.path.join(source_root(), FP8_UTILS), GROUP_QUANT_KERNEL)
    rows, cols = x_MK.shape
    q_MK = torch.empty_like(x_MK, dtype=quant.FP8_DTYPE)
    scale_MG = x_MK.new_empty(rows, cols // group, dtype=torch.float32)
    block = triton.next_power_of_2(group)
    kernel[(rows * (cols // group),)](
        x_MK, q_MK, scale_MG, group, cols, x_MK.stride(0), GROUP_QUANT_EPS,
        fp8_min=-quant.FP8_MAX, fp8_max=quant.FP8_MAX, use_ue8m0=False, BLOCK=block,
        num_warps=min(max(block // 256, 1), 8), num_stages=1)
    return q_MK, scale_MG


def _gemm(kernel, a_RK, a_scale, b_ENK, b_scale, c_SN, topk_weights_TK, sorted_ids,
          block_expert, num_padded, num_rows, top_k, routed_weight, config, mode, out_dtype):
    """One launch of vLLM's kernel: ``c[s] = a[s // top_k] @ b[expert(s)].T`` per routed
    slot, with the scales of ``mode`` applied in fp32."""
    config = {key: value for key, value in config.items() if key != "SPLIT_K"}
    if mode.block_shape is not None:
        config["BLOCK_SIZE_K"] = min(config["BLOCK_SIZE_K"], *mode.block_shape)
    grid = (triton.cdiv(num_rows, config["BLOCK_SIZE_M"])
            * triton.cdiv(b_ENK.shape[1], config["BLOCK_SIZE_N"]),)
    # Strides as vLLM's ``invoke_fused_moe_triton_kernel`` derives them from the scales.
    a_strides = (a_scale.stride(0), a_scale.stride(1)) if a_scale is not None else (0, 0)
    b_strides = (0, 0, 0)
    if b_scale is not None:
        b_strides = (b_scale.stride(0), b_scale.stride(2) if b_scale.ndim == 3 else 0,
                     b_scale.stride(1) if b_scale.ndim >= 2 and b_scale.shape[1] > 1 else 0)
    group_n, group_k = mode.block_shape or (0, 0)
    kernel[grid](
        a_ptr=a_RK, b_ptr=b_ENK, c_ptr=c_SN, b_bias_ptr=None, a_scale_ptr=a_scale,
        b_scale_ptr=b_scale, topk_weights_ptr=topk_weights_TK, sorted_token_ids_ptr=sorted_ids,
        expert_ids_ptr=block_expert, num_tokens_post_padded_ptr=num_padded,
        N=b_ENK.shape[1], K=b_ENK.shape[2], EM=num_rows, num_valid_tokens=c_SN.shape[0],
        stride_am=a_RK.stride(0), stride_ak=a_RK.stride(1), stride_be=b_ENK.stride(0),
        stride_bk=b_ENK.stride(2), stride_bn=b_ENK.stride(1), stride_cm=c_SN.stride(0),
        stride_cn=c_SN.stride(1), stride_asm=a_strides[0], stride_ask=a_strides[1],
        stride_bse=b_strides[0], stride_bsk=b_strides[1], stride_bsn=b_strides[2],
        stride_bbe=0, stride_bbn=0, group_n=group_n, group_k=group_k,
        naive_block_assignment=sorted_ids is None, SPLIT_K=1, MUL_ROUTED_WEIGHT=routed_weight,
        top_k=top_k, compute_type=COMPUTE_TYPES[out_dtype], use_fp8_w8a8=mode.fp8,
        use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=mode.per_channel,
        HAS_BIAS=False, SWAP_AB=_swap_ab(mode, config), **config)


def vllm_peers(shape, num_tokens: int, problem, spec: QuantSpec | None = None,
               scales: tuple[torch.Tensor, torch.Tensor] | None = None
               ) -> dict[str, Callable[[], torch.Tensor]]:
    """``{"vllm-triton": fn}`` on the bench's problem ``(hidden, topk_weights, topk_ids,
    w13, w2, b13, b2)`` with weights in ``spec``'s format (``scales``: their
    ``(w13_scale, w2_scale)``), or {} where `why_not` says it does not run.

    No host sync: every size is known before the call, so ``fn`` can be graph-captured.
    """
    hidden_TH, topk_weights_TK, topk_ids_TK, w13, w2, _, _ = problem
    if why_not(shape, spec, hidden_TH.device) is not None:
        return {}
    mode = mode_of(spec)
    kernel = load_jit(kernel_file(), KERNEL)
    w13_scale, w2_scale = scales or (None, None)
    T, K = topk_ids_TK.shape
    E, H, I = w2.shape
    S = T * K
    config = pick_config(T, E, I, mode)
    block_m = config["BLOCK_SIZE_M"]
    # Activation groups: 1 x bk with block scales, the whole row with per-token ones.
    group_h, group_i = (mode.block_shape[1],) * 2 if mode.block_shape else (H, I)
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
        a_TH, a_scale = quantize_groups(hidden_TH, group_h) if mode.fp8 else (hidden_TH, None)
        gate_up_SF = hidden_TH.new_empty(S, 2 * I)
        _gemm(kernel, a_TH, a_scale, w13, w13_scale, gate_up_SF, *args, K, False, config, mode,
              hidden_TH.dtype)
        act_SI = F.silu(gate_up_SF[:, :I]) * gate_up_SF[:, I:]
        a_SI, a_scale = quantize_groups(act_SI, group_i) if mode.fp8 else (act_SI, None)
        down_SH = hidden_TH.new_empty(S, H)
        _gemm(kernel, a_SI, a_scale, w2, w2_scale, down_SH, *args, 1, True, config, mode,
              hidden_TH.dtype)
        return down_SH.view(T, K, H).sum(dim=1)

    return {"vllm-triton": run}
