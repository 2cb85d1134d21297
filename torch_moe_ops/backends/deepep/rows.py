"""The rows format's ops on DeepEP (``moe::dispatch``, ``moe::dispatch_quant``,
``moe::combine`` and their gradients), in each of its modes (`kernels`): `normal` or
`low_latency`, as the namespace they are registered in says (`modes.ROWS_NAMESPACES`; the
layer's plan picks it), whatever other communicators are open.

Both modes: static shapes, no host sync (unless ``ep_capacity`` is below the worst case:
then dispatch checks, with one all-reduce and a host read, that no rank sends another more
than ``C`` rows, and raises on all of them if one does), so no op needs the
``cudagraph_unsafe`` tag and a layer captures in a CUDA graph in either mode. An idle rank
joins every collective. Where DeepEP's fp8 path does not take the format
(`modes.fp8_transport_reason`), rows travel in bf16 and are quantized on arrival: a row is a
copy of its token, so they get the values quantizing before would give, in twice the bytes.
Quantized layers have no gradient (``moe::dispatch_quant`` raises when asked).
``combine_map_TK`` is the mode's: `normal`'s placeholder, `low_latency`'s expert ids.

Legend: T tokens on this rank, H hidden size, K experts per token, E experts, E_l = E / P
experts per rank, P ranks, C rows one rank may send another (the capacity), R = P * C rows.
"""

from __future__ import annotations

import functools

import torch

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.rows import combine_grads, weighted_rows
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.deepep import low_latency, normal
from torch_moe_ops.backends.deepep.buffer import (
    check_tensor,
    communicators,
    dispatching,
    on,
)
from torch_moe_ops.backends.deepep.modes import LOW_LATENCY, NORMAL, fp8_transport_reason
from torch_moe_ops.config import QuantSpec, worst_case_capacity


def _rows_per_rank(topk_ids_TK: torch.Tensor, num_local: int, ep_size: int) -> torch.Tensor:
    """``[P]``: the rows this rank sends each rank."""
    ids_S = topk_ids_TK.reshape(-1).long()
    dest_S = torch.where(ids_S < 0, ep_size, ids_S // num_local)
    count_X = torch.zeros(ep_size + 1, dtype=torch.int64, device=ids_S.device)
    return count_X.scatter_add_(0, dest_S, torch.ones_like(dest_S))[:ep_size]


def _transport(mode, src_R, group_name, ep_size, max_tokens_per_rank, hidden_size, top_k,
               dtype):
    """The communicator of ``mode`` that ran the dispatch of ``src_R``, and its normal-mode
    handle (None in low-latency mode)."""
    collectives.rank_in(group_name, ep_size)
    if mode == LOW_LATENCY:
        for comm in communicators():
            if comm.mode == LOW_LATENCY and comm.matches(group_name, hidden_size, top_k,
                                                          max_tokens_per_rank, dtype):
                return comm, None
        raise RuntimeError(f"a2a backend 'deepep' has no low-latency communicator on group "
                           f"{group_name!r} for H={hidden_size}, K={top_k}, "
                           f"max_tokens_per_rank={max_tokens_per_rank}: a combine answers the "
                           "low-latency dispatch of the same layer")
    for comm in communicators():
        if comm.mode == NORMAL and comm.group_name == group_name:
            handle = comm.recall(src_R)
            if handle is not None:
                return comm, handle
    raise RuntimeError("src_rows must be the tensor that a2a backend 'deepep''s normal-mode "
                       f"dispatch returned on this rank (group {group_name!r}): its DeepEP "
                       "handle lives as long as that tensor's storage")


def _dispatch(mode, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
              max_tokens_per_rank, capacity, spec=None):
    """Dispatch's six outputs in ``mode``, and with ``spec`` the rows in fp8 and ``x_scale``."""
    num_tokens, top_k = topk_ids_TK.shape
    num_local = num_experts // ep_size
    with dispatching("hidden", hidden_TH, top_k, num_experts, ep_size, group_name,
                     max_tokens_per_rank, mode) as comm:
        comm.check_tokens(num_tokens)
        if capacity < worst_case_capacity(max_tokens_per_rank, top_k):
            collectives.check_capacity(_rows_per_rank(topk_ids_TK, num_local, ep_size), capacity,
                                       group_name,
                                       "a rank sends another more rows than the capacity")
        run = low_latency.dispatch if mode == LOW_LATENCY else normal.dispatch
        args = (comm, hidden_TH, topk_weights_TK, topk_ids_TK, ep_size * capacity)
        if spec is None or fp8_transport_reason(mode, spec, hidden_TH.shape[1]) is None:
            return run(*args, spec)
        # A row is a copy of its token: quantized here, it gets the values quantizing
        # the token before it left would have given.
        x_RH, *routing = run(*args)
        q_RH, x_scale = quant.quantize_activations(x_RH, spec)
        return (q_RH, *routing, x_scale)


def dispatch(mode, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
             max_tokens_per_rank, capacity):
    return _dispatch(mode, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
                     group_name, max_tokens_per_rank, capacity)


def dispatch_quant(mode, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, weight_format,
                   activation_format, block_size, ep_size, group_name, max_tokens_per_rank,
                   capacity):
    spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
    return _dispatch(mode, hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
                     group_name, max_tokens_per_rank, capacity, spec)


def combine(mode, y_RH, weight_R, src_R, combine_map_TK, ep_size, group_name,
            max_tokens_per_rank):
    check_tensor("y_rows", y_RH)
    num_tokens, top_k = combine_map_TK.shape
    with on(y_RH.device):
        comm, handle = _transport(mode, src_R, group_name, ep_size, max_tokens_per_rank,
                                  y_RH.shape[1], top_k, y_RH.dtype)
        rows_RH = weighted_rows(y_RH, weight_R, src_R)
        if mode == LOW_LATENCY:
            return low_latency.combine(comm, rows_RH, src_R, combine_map_TK)
        return normal.combine(comm, handle, rows_RH, src_R, num_tokens, top_k)


def dispatch_backward(mode, grad_x_RH, grad_weight_R, src_R, combine_map_TK, ep_size,
                      group_name, max_tokens_per_rank):
    check_tensor("grad_x_rows", grad_x_RH)
    num_tokens, top_k = combine_map_TK.shape
    with on(grad_x_RH.device):
        comm, handle = _transport(mode, src_R, group_name, ep_size, max_tokens_per_rank,
                                  grad_x_RH.shape[1], top_k, grad_x_RH.dtype)
        if mode == LOW_LATENCY:
            return (low_latency.combine(comm, grad_x_RH, src_R, combine_map_TK),
                    low_latency.weight_grads(comm, grad_weight_R, src_R, combine_map_TK))
        grad_hidden_TH, grad_weights_TK = normal.combine(comm, handle, grad_x_RH, src_R,
                                                          num_tokens, top_k, grad_weight_R)
        return grad_hidden_TH, grad_weights_TK.float()


def combine_backward(mode, grad_out_TH, y_RH, weight_R, src_R, combine_map_TK, ep_size,
                     group_name, max_tokens_per_rank):
    check_tensor("y_rows", y_RH)
    top_k = combine_map_TK.shape[1]
    with on(y_RH.device):
        comm, handle = _transport(mode, src_R, group_name, ep_size, max_tokens_per_rank,
                                  y_RH.shape[1], top_k, y_RH.dtype)
        if mode == LOW_LATENCY:
            grad_RH = low_latency.send_out(comm, grad_out_TH, src_R, combine_map_TK)
        else:
            grad_RH = normal.send_out(comm, handle, grad_out_TH, src_R, top_k)
        return combine_grads(grad_RH, y_RH, weight_R, src_R)


def kernels(mode: str) -> dict:
    """The rows format's kernels in ``mode``, by op name (`ops.define_backend_ops`)."""
    return {name: functools.partial(kernel, mode) for name, kernel in (
        ("dispatch", dispatch), ("combine", combine), ("dispatch_backward", dispatch_backward),
        ("combine_backward", combine_backward), ("dispatch_quant", dispatch_quant))}
