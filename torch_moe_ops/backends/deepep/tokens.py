"""The tokens format (`ops.tokens`) on DeepEP's normal mode, for layers without gradients:
``Buffer.dispatch(num_worst_tokens=N)``'s receive buffers are ``dispatch_tokens``' outputs
as they are, and ``combine_tokens`` is ``Buffer.combine`` of the experts' ``[N, H]``.

DeepEP sends each token once to each rank that holds one of its experts, with its routing
weights and its ids made local there (-1: another rank's expert, weight 0), and packs what
a rank receives: the tokens of rank 0, then of rank 1, ..., in the order they came, then
padding up to N whose ids DeepEP sets to -1 (its activations and weights are left as they
were: the experts skip them). Normal mode runs every token count, decode sizes too, with
static sizes and no host sync, so the pair captures in a CUDA graph.

Bookkeeping around DeepEP's calls: the ids cast to DeepEP's ``topk_idx_t`` (int64) going
out and the received ids back to int32 (the contract's dtype), and an idle rank's one
padding row (DeepEP's kernels take no empty tensor). They stay inside the ops rather than
traced into the compiled graph: the casts are one elementwise kernel each on ``[T, K]``
and ``[N, K]``, and DeepEP's layout and dispatch calls are Python on a ``Buffer`` that
Inductor cannot trace, so tracing would only fuse those two casts into neighbours.

DeepEP's handle (prefix matrices, send heads) stays in the communicator
(`DeepEPCommunicator.tokens_dispatch`) until ``combine_tokens`` answers the
``dispatch_tokens`` before it, as the format's contract says, once: a second combine of
the same dispatch raises. No gradient ops: a gradient needs the handle of the same
layer's forward while several layers' are in flight, and the contract's backward
gets only the layer's ``topk_ids`` (an input, which two layers may share and a compiled
backward may get as a recomputed copy), not an output of the dispatch to key it on as the
rows format keys it on ``src_rows``. A layer that trains takes the rows format.

Legend: T tokens on this rank, T1 = max(T, 1) tokens handed to DeepEP, H hidden size, K
experts per token, E experts, P ranks, M = max_tokens_per_rank, N = P * M positions.
"""

from __future__ import annotations

import torch

from torch_moe_ops.backends.deepep import normal
from torch_moe_ops.backends.deepep.buffer import (
    TokensDispatch,
    answering,
    dispatching,
    pad_tokens,
)
from torch_moe_ops.backends.deepep.modes import NORMAL


def dispatch_tokens(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                    max_tokens_per_rank):
    num_tokens, top_k = topk_ids_TK.shape
    with dispatching("hidden", hidden_TH, top_k, num_experts, ep_size, group_name,
                     max_tokens_per_rank, NORMAL) as comm:
        x_TH = pad_tokens(hidden_TH, max(num_tokens, 1), 0)
        x_NH, ids_NK, weights_NK, handle = normal.send(comm, x_TH, topk_weights_TK, topk_ids_TK)
        comm.tokens_dispatch = TokensDispatch(handle, num_tokens)
        return x_NH, weights_NK, ids_NK.to(torch.int32)


def combine_tokens(y_NH, topk_ids_TK, num_experts, ep_size, group_name, max_tokens_per_rank):
    num_tokens, top_k = topk_ids_TK.shape
    with answering("y_tokens", y_NH, top_k, num_experts, ep_size, group_name,
                   max_tokens_per_rank, NORMAL) as comm:
        sent = comm.tokens_dispatch
        if sent is None or sent.num_tokens != num_tokens:
            raise RuntimeError(f"a2a backend 'deepep': combine_tokens of {num_tokens} tokens "
                               f"must answer the dispatch_tokens before it on {comm!r}, which "
                               + ("did not run" if sent is None else
                                  f"sent {sent.num_tokens} tokens"))
        combined_TH, _, _ = comm.buffer.combine(y_NH.contiguous(), sent.handle,
                                                config=comm.combine_config)
        # One combine answers one dispatch, and the handle dies with it: held past the pair,
        # its tensors would be allocations of a CUDA-graph pool that no output accounts
        # for ("tensor(s) in the cudagraph pool not tracked as outputs").
        comm.tokens_dispatch = None
        return combined_TH[:num_tokens]
