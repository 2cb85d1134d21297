"""The ``flashinfer`` a2a backend as the registry sees it: what it `supports` (torch.distributed,
triton, a shape FlashInfer's kernels are built for, NVLink-joined GPUs and a workspace some
GPU could hold) and its ops in namespace ``moe_flashinfer_a2a`` (and, for layers that train in
the tokens format, ``moe_flashinfer_a2a_trainable``), registered on import."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from torch_moe_ops.backends.common import TRITON_INSTALLED
from torch_moe_ops.backends.flashinfer import a2a_sizes as sizes
from torch_moe_ops.backends.flashinfer import library
from torch_moe_ops.backends.flashinfer.a2a import comm_api, trainable_tokens
from torch_moe_ops.backends.flashinfer.a2a.rows import (
    combine,
    combine_backward,
    dispatch,
    dispatch_backward,
)
from torch_moe_ops.backends.flashinfer.a2a.tokens import combine_tokens, dispatch_tokens
from torch_moe_ops.backends.flashinfer.a2a.workspace import communicator
from torch_moe_ops.backends.registry import REGISTRY, A2ABackend
from torch_moe_ops.ops import define_backend_ops

NAME = "flashinfer"
NAMESPACE = "moe_flashinfer_a2a"
TRAINING_NAMESPACE = "moe_flashinfer_a2a_trainable"


@functools.cache
def _nvlink_reason(index: int) -> str | None:
    """Why GPU ``index`` cannot take part (flashinfer's check: NVLinks, every one up)."""
    try:
        with torch.cuda.device(index):
            linked = comm_api.api().MnnvlMemory.supports_mnnvl()
    except Exception as error:  # noqa: BLE001 (NVML's failure is the reason, reported)
        return f"NVML could not tell whether GPU {index} has NVLink: {error}"
    if not linked:
        return (f"needs GPUs joined by NVLink with every link up, and GPU {index} is not "
                "(flashinfer's MnnvlMemory.supports_mnnvl())")
    return None


def supports(spec, problem, device) -> str | None:
    """Why this backend cannot carry ``problem`` on ``device``, or None where it can."""
    if not dist.is_available():
        return "this torch has no torch.distributed"
    if problem.ep_size is not None and problem.ep_size < 2:
        return "needs expert parallelism (ep_size > 1); a2a 'none' runs one device"
    if not TRITON_INSTALLED:
        return "triton is not installed (pip install triton): it marks the received ids"
    reason = sizes.why_not_shape(problem.ep_size, problem.top_k, problem.dtype,
                                 problem.num_experts, problem.hidden_size)
    if reason is not None:
        return reason
    reason = library.device_reason(device)
    if reason is not None:
        return reason
    index = device.index if device.index is not None else torch.cuda.current_device()
    reason = _nvlink_reason(index)
    if reason is not None:
        return reason
    shape = (problem.ep_size, problem.max_tokens_per_rank, problem.hidden_size, problem.top_k)
    if None in shape:
        return None
    # The exact size (with flashinfer's own region) and the free memory are checked when the
    # workspace is allocated; here, what no GPU of this kind could hold.
    return sizes.why_not_fits(sizes.payload_bytes(*shape, problem.dtype),
                              torch.cuda.get_device_properties(index).total_memory, *shape,
                              problem.dtype, available="in all")


# The tokens ops here have no gradient ops: their buffers are the workspace's, which the
# next dispatch overwrites. A layer that trains takes those of TRAINING_NAMESPACE, which copy
# the buffers out (`trainable_tokens`).
define_backend_ops(NAMESPACE, {"dispatch": dispatch, "combine": combine,
                               "dispatch_backward": dispatch_backward,
                               "combine_backward": combine_backward,
                               "dispatch_tokens": dispatch_tokens,
                               "combine_tokens": combine_tokens})
define_backend_ops(TRAINING_NAMESPACE, {
    "dispatch_tokens": trainable_tokens.dispatch_tokens,
    "combine_tokens": trainable_tokens.combine_tokens,
    "dispatch_tokens_backward": trainable_tokens.dispatch_tokens_backward,
    "combine_tokens_backward": trainable_tokens.combine_tokens_backward})

def prepare(fmt, mode, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
            group_name, max_tokens_per_rank) -> None:
    """The layer's communicator (one for both formats, in its engine's one mode), opened
    when the layer is compiled: made in a warm-up run of ``mode="reduce-overhead"``, its
    tensors would stay in the CUDA graphs' memory pool."""
    communicator(group_name, hidden_TH.shape[1], topk_ids_TK.shape[1], max_tokens_per_rank,
                 hidden_TH.dtype, hidden_TH.device)


REGISTRY.register_a2a(A2ABackend(
    name=NAME, namespace=NAMESPACE, training_namespace=TRAINING_NAMESPACE, supports=supports,
    prepare=prepare,
    description="FlashInfer's MoE all-to-all (NVLink one-sided, static per-rank capacity)"))
