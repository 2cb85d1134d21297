"""OpenAI's ``triton_kernels`` MXFP4 MoE path (``matmul_ogs``) as a peer of bench_experts.py,
loaded from a local copy: the kernels vLLM serves GPT-OSS with on Hopper.

Legend: T tokens, K experts per token, S = T * K routed slots, E experts, H hidden size,
I expert intermediate size, F = 2 * I; one expert matrix has N output rows and C input
columns (``w13``: N = F, C = H; ``w2``: N = H, C = I), P = C / 2 packed bytes and
G = C / 32 scale groups a row.

The code is not part of this repository: it is read at run time from a folder that git
ignores, ``<repo>/.peers/triton_kernels`` or ``$TMO_TRITON_KERNELS_SRC``, laid out as
vLLM's tree (an unpacked vLLM wheel works as well):

    vllm/third_party/triton_kernels/                        triton_kernels (about 40 files)
    vllm/model_executor/layers/fused_moe/experts/gpt_oss_triton_kernels_moe.py
                                                            vLLM's routing bitmatrix kernel

One way to fill it, from vLLM's wheel (about 340 MB, of which about 290 KB is kept):

    pip download vllm==0.33.0 --no-deps -d <dir>
    unzip <dir>/vllm-0.33.0-*.whl -d .peers/triton_kernels \\
        'vllm/third_party/triton_kernels/*' \\
        'vllm/model_executor/layers/fused_moe/experts/gpt_oss_triton_kernels_moe.py'
    echo "triton_kernels from vLLM 0.33.0's PyPI wheel" > .peers/triton_kernels/SOURCE

triton_kernels' modules import ``triton_kernels.*`` absolutely: the folder that holds it,
``vllm/third_party``, goes first on ``sys.path`` (`add_to_import_path`). vLLM 0.33.0
vendors the API generation it calls "3.5.1" (``routing.py``'s ``routing_from_bitmatrix``,
which vLLM calls for that generation only); this peer calls that API. The ``vllm`` package is
not imported (it needs its compiled CUDA ops): its one ``@triton.jit`` kernel used here
is cut out of its file (`peer_vllm.load_jit`).

What one call runs: vLLM's modular path (``OAITritonExperts``: routing already done, as
our experts ops take it), with vLLM's arguments:

    routing   = routing_from_bitmatrix(pack_bitmatrix(ids_TK as int16), weights_TK as bf16)
    act_SI    = matmul_ogs(x_TH, w13, b13, routing, gather_indx,
                           fused_activation=swiglu(alpha, limit) on interleaved gate/up)
    out_TH    = matmul_ogs(act_SI, w2, b2, routing, scatter_indx, gammas=routing weights)
                (its scatter sums each token's K rows: the weighted combine)

vLLM's monolithic path fuses the top-k over router logits into the routing kernel; no row
here times routing from logits, ours included.

Weights: our stored ``QuantSpec("mxfp4")`` weights (``w13 [E, F, H/2]`` gate rows then up
rows, ``w2 [E, H, I/2]``, e8m0 scales ``[E, N, G]``, biases in the activations' dtype)
are converted once, outside every timed region, as vLLM's ``_swizzle_mxfp4`` converts a
GPT-OSS checkpoint on sm90 (`kernel_weights`):

- ``w13``'s rows, scales and bias interleaved ``g0, u0, g1, u1, ...``: the fused swiglu
  reads the gate from even and the up from odd columns (GPT-OSS's own order);
- each matrix ``[E, N, P]`` read as ``W [E, C, N]`` (``matmul_ogs`` computes
  ``x @ W[e]``), the packed axis C contiguous, in ``HopperMXValueLayout(mx_axis=1)``;
- its scales padded to a multiple of 4 groups (vLLM's sm90 workaround for this kernel
  generation), read as ``[E, G, N]``, in ``HopperMXScaleLayout(mx_axis=1, num_warps=8)``;
- biases in fp32; and ``split_k = 1`` for every launch (vLLM's sm90 setting, kept in
  triton_kernels' own opt-flags state).

The Hopper layouts make this an sm90 peer: `why_not` says so on any other device.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import peer_vllm
import torch
import torch.nn.functional as F
import triton
from weight_formats import ExpertWeights

from torch_moe_ops.config import QuantSpec

if TYPE_CHECKING:
    # Only where present: `add_to_import_path` finds it at run time.
    from triton_kernels.matmul_ogs import PrecisionConfig
    from triton_kernels.tensor import Tensor

NAME = "triton-kernels"
PACKAGE_PARENT = os.path.join("vllm", "third_party")
PACKAGE_FILES = tuple(os.path.join(PACKAGE_PARENT, "triton_kernels", name)
                      for name in ("matmul_ogs.py", "routing.py", "swiglu.py"))
VLLM_MOE_FILE = os.path.join("vllm", "model_executor", "layers", "fused_moe", "experts",
                             "gpt_oss_triton_kernels_moe.py")
PACK_KERNEL = "pack_bitmatrix"
# vLLM's launch of it (make_routing_data): token rows per program, expert bits per word.
PACK_BLOCK_ROWS, BITS_PER_WORD = 512, 32
HOPPER = (9, 0)
# vLLM's _swizzle_mxfp4 on sm90: the scale layout's warps, and the scale groups padded
# to a multiple of 4 (its workaround for this generation's Hopper scale reads).
SCALE_LAYOUT_WARPS = 8
SCALE_GROUP_MULTIPLE = 4
# The fused swiglu takes two input columns (gate, up) per output column.
SWIGLU_REDUCTION = 2


def source_root() -> str:
    return os.environ.get("TMO_TRITON_KERNELS_SRC") or os.path.join(peer_vllm.REPO, ".peers",
                                                                     "triton_kernels")


def package_parent() -> str:
    """The folder that holds ``triton_kernels/``: what goes on ``sys.path``."""
    return os.path.join(source_root(), PACKAGE_PARENT)


def missing_file() -> str | None:
    """The first file this peer needs that ``source_root()`` lacks, None when none is."""
    for path in (*PACKAGE_FILES, VLLM_MOE_FILE):
        if not os.path.isfile(os.path.join(source_root(), path)):
            return path
    return None


def source_version() -> str | None:
    """What the peer runs, for a results header: the first line of the folder's ``SOURCE``
    note, or None where a file it needs is missing."""
    if missing_file() is not None:
        return None
    return peer_vllm.source_note(source_root()) or "triton_kernels without a SOURCE note"


def why_not(shape, spec: QuantSpec | None, device: torch.device) -> str | None:
    """Why the peer does not run ``shape`` in ``spec``'s format on ``device``, or None."""
    if spec is None or spec.weights != "mxfp4":
        return "triton_kernels' matmul_ogs runs here for mxfp4 weights only (W4A16, GPT-OSS)"
    missing = missing_file()
    if missing is not None:
        return (f"no {missing} under {peer_vllm.shown_path(source_root())} "
                "(see benchmarks/peer_triton_kernels.py)")
    if shape.activation != "swiglu_oai":
        return "vLLM runs matmul_ogs with its fused swiglu_oai only (GPT-OSS's activation)"
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != HOPPER:
        # Its Hopper layouts are read with inline PTX: no interpreter runs them.
        return "the peer lays weights out for Hopper (sm90) as vLLM does there; needs an sm90 GPU"
    return None


def add_to_import_path() -> None:
    """Puts `package_parent()` first on ``sys.path`` (where it is not yet on it)."""
    parent = package_parent()
    if parent not in sys.path:
        sys.path.insert(0, parent)


@dataclasses.dataclass(frozen=True)
class KernelWeights:
    """One layer's experts as ``matmul_ogs`` reads them: triton_kernels ``Tensor``s of
    logical shape ``W [E, C, N]`` in Hopper's value layout (``w13`` columns interleaved
    gate, up), their ``PrecisionConfig``s holding the scales, fp32 biases (``b13``
    interleaved)."""

    w13_EHF: Tensor
    w2_EIH: Tensor
    w13_precision: PrecisionConfig
    w2_precision: PrecisionConfig
    b13_EF: torch.Tensor | None
    b2_EH: torch.Tensor | None


def interleave_gate_up(gate_then_up_EF: torch.Tensor) -> torch.Tensor:
    """``[E, F, ...]`` with the gate rows then the up rows (ours) -> rows
    ``g0, u0, g1, u1, ...`` (GPT-OSS's order, which the fused swiglu reads)."""
    gate_EI, up_EI = gate_then_up_EF.chunk(2, dim=1)
    return torch.stack([gate_EI, up_EI], dim=2).flatten(1, 2)


def hopper_mx(q_ENP: torch.Tensor, scale_ENG: torch.Tensor) -> tuple[Tensor, PrecisionConfig]:
    """``(W [E, C, N], PrecisionConfig)`` of one packed mxfp4 matrix in vLLM's sm90 layouts."""
    add_to_import_path()
    from triton_kernels.matmul_ogs import PrecisionConfig
    from triton_kernels.tensor import FP4, convert_layout, wrap_torch_tensor
    from triton_kernels.tensor_details.layout import HopperMXScaleLayout, HopperMXValueLayout

    scale_ENG = F.pad(scale_ENG, (0, -scale_ENG.shape[-1] % SCALE_GROUP_MULTIPLE))
    # Transposed views keep C contiguous: wrap_torch_tensor doubles the contiguous axis
    # (two e2m1 values a byte), and mx_axis=1 names it to the layouts.
    w_ECN = convert_layout(wrap_torch_tensor(q_ENP.mT, dtype=FP4), HopperMXValueLayout,
                           mx_axis=1)
    scale_EGN = convert_layout(wrap_torch_tensor(scale_ENG.mT), HopperMXScaleLayout, mx_axis=1,
                               num_warps=SCALE_LAYOUT_WARPS)
    return w_ECN, PrecisionConfig(weight_scale=scale_EGN)


def kernel_weights(weights: ExpertWeights) -> KernelWeights:
    """``weights`` (mxfp4, as bench_experts.py stores them) converted once into what
    ``matmul_ogs`` reads, on their device; sets ``split_k = 1`` as vLLM does on sm90."""
    add_to_import_path()
    from triton_kernels.matmul_ogs_details.opt_flags import update_opt_flags_constraints

    update_opt_flags_constraints({"split_k": 1})
    w13_EHF, w13_precision = hopper_mx(interleave_gate_up(weights.w13),
                                       interleave_gate_up(weights.w13_scale))
    w2_EIH, w2_precision = hopper_mx(weights.w2, weights.w2_scale)
    b13_EF = None if weights.b13_EF is None else interleave_gate_up(weights.b13_EF).float()
    b2_EH = None if weights.b2_EH is None else weights.b2_EH.float()
    return KernelWeights(w13_EHF, w2_EIH, w13_precision, w2_precision, b13_EF, b2_EH)


def routing_data(topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, num_experts: int):
    """``(RoutingData, GatherIndx, ScatterIndx)`` of routed ids and weights, as vLLM's
    ``make_routing_data`` builds them: ids as int16 and weights as bf16 (its casts), one
    bit per (token, expert) packed by vLLM's ``pack_bitmatrix``, then triton_kernels'
    ``routing_from_bitmatrix`` (slots sorted by expert, tile maps per block size). No slot
    is -1 without expert parallelism: vLLM's masking of those is left out."""
    add_to_import_path()
    from triton_kernels.routing import routing_from_bitmatrix
    from triton_kernels.tensor import Bitmatrix

    pack = peer_vllm.load_jit(os.path.join(source_root(), VLLM_MOE_FILE), PACK_KERNEL)
    T, K = topk_ids_TK.shape
    ids_TK = topk_ids_TK.to(torch.int16)
    weights_TK = topk_weights_TK.to(torch.bfloat16)
    words = triton.cdiv(num_experts, BITS_PER_WORD)
    bits_TW = torch.zeros((T, words), dtype=torch.uint32, device=ids_TK.device)
    pack[(triton.cdiv(T, PACK_BLOCK_ROWS),)](bits_TW, ids_TK, T, words, K,
                                             BLOCK_SIZE_M=PACK_BLOCK_ROWS,
                                             BLOCK_SIZE_K=BITS_PER_WORD)
    bitmatrix = Bitmatrix(bits_TW, shape=[T, words * BITS_PER_WORD], shape_max=[T, None],
                          scratchpad=None)
    return routing_from_bitmatrix(bitmatrix, weights_TK, ids_TK, num_experts, K)


def triton_kernels_run(routing, weights: KernelWeights, swiglu: tuple[float, float]
                       ) -> Callable[[], torch.Tensor]:
    """The peer's call on the bench's ``routing = (hidden [T, H], topk_weights [T, K],
    topk_ids [T, K])`` with ``swiglu = (alpha, limit)``: routing, both GEMMs, the
    activation and the combine, ``[T, H]`` out. No host sync, as vLLM graph-captures it."""
    add_to_import_path()
    from triton_kernels.matmul_ogs import FnSpecs, FusedActivation, matmul_ogs
    from triton_kernels.swiglu import swiglu_fn

    hidden_TH, topk_weights_TK, topk_ids_TK = routing
    num_experts = weights.w13_EHF.shape[0]
    activation = FusedActivation(FnSpecs("swiglu", swiglu_fn, ("alpha", "limit")), swiglu,
                                 SWIGLU_REDUCTION)

    def run() -> torch.Tensor:
        data, gather, scatter = routing_data(topk_ids_TK, topk_weights_TK, num_experts)
        act_SI = matmul_ogs(hidden_TH, weights.w13_EHF, weights.b13_EF, data,
                            gather_indx=gather, precision_config=weights.w13_precision,
                            fused_activation=activation)
        return matmul_ogs(act_SI, weights.w2_EIH, weights.b2_EH, data, scatter_indx=scatter,
                          precision_config=weights.w2_precision, gammas=data.gate_scal)

    return run
