"""The tokens format's ops on FlashInfer's all-to-all (`ops.tokens`, for layers without
gradients): ``dispatch_tokens`` hands over the receive
buffers as they are, views of the workspace with no copy, with the ids made local to this
rank's experts (-1 at padding); ``combine_tokens`` hands the experts' output back to
FlashInfer's combine. The buffers are the next dispatch's: inference only (a layer that
trains takes `trainable_tokens`).

Legend: T tokens on this rank, M = max_tokens_per_rank, P ranks, N = P * M receive
positions, H hidden size, K experts per token.
"""

from __future__ import annotations

from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.flashinfer.a2a.comm_api import check_activations, on
from torch_moe_ops.backends.flashinfer.a2a.workspace import answering, communicator


def dispatch_tokens(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                    max_tokens_per_rank):
    check_activations("hidden", hidden_TH)
    collectives.rank_in(group_name, ep_size)
    with on(hidden_TH.device):
        comm = communicator(group_name, hidden_TH.shape[1], topk_ids_TK.shape[1],
                            max_tokens_per_rank, hidden_TH.dtype, hidden_TH.device)
        x_NH, weights_NK, ids_NK = comm.send_tokens(hidden_TH, topk_weights_TK, topk_ids_TK,
                                                    num_experts)
        return comm.alias(x_NH), comm.alias(weights_NK), comm.local_ids(ids_NK, num_experts)


def combine_tokens(y_NH, topk_ids_TK, num_experts, ep_size, group_name, max_tokens_per_rank):
    num_tokens, top_k = topk_ids_TK.shape
    with answering("y_tokens", y_NH, top_k, group_name, ep_size,
                   max_tokens_per_rank) as comm:
        return comm.combine(y_NH, num_tokens)
