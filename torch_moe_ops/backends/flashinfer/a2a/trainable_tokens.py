"""The tokens format's ops on FlashInfer's all-to-all for layers that train (`ops.tokens`,
with its gradient ops), in namespace ``moe_flashinfer_a2a_trainable``: the receive buffers
are copied out of the workspace, in token order (`common.transport.token_positions`), so
that what the experts save for their gradient outlives the next dispatch, which overwrites
the workspace, and the gradients find each token where the forward put it.

FlashInfer's dispatch puts a rank's tokens in its block in the order an atomic counter
hands them out (one thread block per token, ``atomicAdd`` on the target's send counter in
moeAlltoAllKernels.cu), an order that changes from call to call: a receive position is not
a function of (source rank, token index). So every dispatch here carries each token's index
beside it, the receiver gathers what arrived into token order (the copy out of the
workspace that the gradient needs anyway, as a gather), and scatters rows back into the
order of arrival before each combine (`bookkeeping`).

- ``dispatch_tokens``: FlashInfer's dispatch of the tokens, weights, ids and index; the
  buffers in token order, ids made local.
- ``combine_tokens``: the experts' output in the order its tokens arrived, FlashInfer's
  combine (answering the dispatch before it).
- ``combine_tokens_backward``: FlashInfer's dispatch of ``grad_out`` (with ids and index),
  in token order. It leaves its round open for
- ``dispatch_tokens_backward``: the activations' gradients in the order of arrival of that
  dispatch, and FlashInfer's combine answers it. Autograd runs one layer's two gradients in
  that order with no other layer's between them (the gradient of a layer's dispatch feeds
  the layers before it); where it never runs the second (no input of the layer's dispatch
  needs a gradient), the next dispatch closes the round (`FlashInferCommunicator.dispatch`).
  The routing weights' gradients (fp32, exact) go home by one ``all_to_all`` over the
  group, as the ``all_to_all`` backend sends them (`token_positions.home`, its sum
  compiled: `bookkeeping.summed_home`).

A layer's training step is thus two FlashInfer round trips and one ``all_to_all`` of
``[N, K]`` fp32 (the rows format: three round trips and the same ``all_to_all``).

Legend: T tokens on this rank, M = max_tokens_per_rank, P ranks, N = P * M receive
positions, H hidden size, K experts per token.
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.flashinfer.a2a.bookkeeping import (
    rows_in_arrival_order,
    rows_in_token_order,
    summed_home,
    token_index,
    tokens_in_token_order,
)
from torch_moe_ops.backends.flashinfer.a2a.comm_api import check_activations, on
from torch_moe_ops.backends.flashinfer.a2a.workspace import (
    FlashInferCommunicator,
    answering,
    communicator,
)


def _order_args(comm: FlashInferCommunicator, num_experts: int) -> tuple:
    """What the reordering reads of the last dispatch: its arrivals' ids and token indices,
    the tokens each rank sent (the receive counters: FlashInfer's id sanitizer, a launch,
    is not needed to find the padding), this rank and its expert count, M."""
    received = comm.received
    return (received.ids_NK, received.token_N1, comm.recv_counts_P, comm.rank,
            num_experts // comm.ep_size, comm.max_tokens_per_rank)


def _combine(comm: FlashInferCommunicator, rows_NH: torch.Tensor, num_experts: int,
             num_tokens: int, gradient: bool, follows: str) -> torch.Tensor:
    """FlashInfer's combine of ``rows_NH`` (in token order), answering the last dispatch,
    which must be ``follows`` (a gradient's where ``gradient``)."""
    received = comm.received
    if received is None or received.ids_NK is None or received.gradient != gradient:
        raise RuntimeError(f"a2a backend 'flashinfer' (trainable tokens): {follows} on {comm!r}")
    payload_NH = rows_in_arrival_order(rows_NH, *_order_args(comm, num_experts))
    return comm.combine(payload_NH, num_tokens)


def dispatch_tokens(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                    max_tokens_per_rank):
    check_activations("hidden", hidden_TH)
    collectives.rank_in(group_name, ep_size)
    num_tokens, top_k = topk_ids_TK.shape
    with on(hidden_TH.device):
        comm = communicator(group_name, hidden_TH.shape[1], top_k, max_tokens_per_rank,
                            hidden_TH.dtype, hidden_TH.device)
        x_NH, weights_NK, ids_NK, token_N1 = comm.send_tokens(
            hidden_TH, topk_weights_TK, topk_ids_TK, num_experts,
            token_index(num_tokens, hidden_TH.device), mark_padding=False)
        comm.received.ids_NK, comm.received.token_N1 = ids_NK, token_N1
        return tokens_in_token_order(x_NH, weights_NK, *_order_args(comm, num_experts))


def combine_tokens(y_NH, topk_ids_TK, num_experts, ep_size, group_name, max_tokens_per_rank):
    num_tokens, top_k = topk_ids_TK.shape
    with answering("y_tokens", y_NH, top_k, group_name, ep_size,
                   max_tokens_per_rank) as comm:
        return _combine(comm, y_NH, num_experts, num_tokens, gradient=False,
                        follows="combine_tokens must follow the dispatch_tokens of its layer")


def combine_tokens_backward(grad_out_TH, topk_ids_TK, num_experts, ep_size, group_name,
                            max_tokens_per_rank):
    num_tokens, top_k = topk_ids_TK.shape
    with answering("grad_out", grad_out_TH, top_k, group_name, ep_size,
                   max_tokens_per_rank) as comm:
        ids_TK = topk_ids_TK.to(torch.int32)
        grad_NH, ids_NK, token_N1 = comm.dispatch(
            ids_TK, num_experts, [grad_out_TH, ids_TK, token_index(num_tokens, ids_TK.device)],
            mark_padding=False)
        comm.received.ids_NK, comm.received.token_N1 = ids_NK, token_N1
        comm.received.gradient = True
        return rows_in_token_order(grad_NH, *_order_args(comm, num_experts))


def dispatch_tokens_backward(grad_x_NH, grad_weights_NK, topk_ids_TK, num_experts, ep_size,
                             group_name, max_tokens_per_rank):
    num_tokens, top_k = topk_ids_TK.shape
    with answering("grad_x_tokens", grad_x_NH, top_k, group_name, ep_size,
                   max_tokens_per_rank) as comm:
        grad_hidden_TH = _combine(
            comm, grad_x_NH, num_experts, num_tokens, gradient=True,
            follows="dispatch_tokens_backward must follow the combine_tokens_backward of its "
                    "layer")
        returned_NK = collectives.all_to_all(grad_weights_NK, group_name, ep_size)
        ids_MK = torch.nn.functional.pad(topk_ids_TK, (0, 0, 0, max_tokens_per_rank - num_tokens),
                                         value=-1)
        return grad_hidden_TH, summed_home(returned_NK, ids_MK, num_experts, ep_size,
                                           max_tokens_per_rank)[:num_tokens]
