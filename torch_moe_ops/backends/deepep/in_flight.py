"""The tokens format in flight (`ops.tokens_in_flight`) on DeepEP's normal mode: each
dispatch and combine is issued by one op and waited by the graph's own wait node, so that
the work of the graph that needs no routed tokens (shared experts) runs while DeepEP's
kernels move them, and chunk i's experts while chunk i + 1's tokens travel.

``dispatch_tokens_start`` runs ``Buffer.dispatch(async_finish=True)``: DeepEP's kernels
run on its communication stream, which first waits for the current one. Behind them, on
that stream, the received ids and weights are packed into the routing columns
(`common.transport.token_routing`, the ids global again, so that ``dispatch_tokens_finish``
is every transport's `token_routing.finish_dispatch`), and an event marks the end. Each
output is registered with torch.distributed as in flight (`_arriving`,
`torch_compat.register_in_flight`): the graph's
``_c10d_functional.wait_tensor`` node, the same wait a functional collective gets, makes
the current stream wait for that event, and Inductor and CUDA graphs treat it as they
treat a collective's. ``combine_tokens_start`` likewise runs ``Buffer.combine`` of one
chunk's ``[N, H]`` and returns its tokens' sums, ``[M, H]`` (the window's padding rows,
routed nowhere, come back zero): DeepEP sums at home itself, so there is no
``combine_tokens_finish``. Neither op hands DeepEP a tensor of the graph's: its kernels
read after the op returns, and Inductor, which keeps a functional collective's input
alive until the wait, may give a custom op's input buffer to the next kernel (2 GPUs,
CUDA graph trees' warm-up, 2026-11-29: 29% of a rank's output wrong when the combine read
the experts' output buffer in place).

Each chunk's DeepEP handle stays in the communicator (`DeepEPCommunicator.in_flight`,
by chunk) from its dispatch to its combine. On the CPU (the tests' stand-in for DeepEP)
everything runs on one stream and the wait has nothing to wait for.

Legend: T tokens on this rank, H hidden size, K experts per token, E experts, P ranks,
M = max_tokens_per_rank of one chunk, N = P * M positions.
"""

from __future__ import annotations

import contextlib

import torch

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.common.transport.token_routing import routing_columns
from torch_moe_ops.backends.deepep import normal
from torch_moe_ops.backends.deepep.buffer import answering, dispatching
from torch_moe_ops.backends.deepep.modes import NORMAL
from torch_moe_ops.ops.tokens_in_flight import window_rows


def _on_comm_stream(comm, device: torch.device):
    """DeepEP's communication stream current (on the CPU: nothing to switch)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(comm.buffer.get_comm_stream())


def _arriving(device: torch.device, *in_flight: torch.Tensor) -> None:
    """Register ``in_flight`` (written by work queued on the current stream, DeepEP's
    communication stream) so that a ``wait_tensor`` of each makes the stream then current
    wait for that work, as for a functional collective's result."""
    if device.type != "cuda":
        def arrived():
            pass
    else:
        done = torch.cuda.Event()
        done.record()

        def arrived():
            torch.cuda.current_stream().wait_event(done)
    for tensor in in_flight:
        torch_compat.register_in_flight(tensor, arrived)


def dispatch_tokens_start(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
                          group_name, max_tokens_per_rank, chunk, num_chunks):
    top_k = topk_ids_TK.shape[1]
    window = (chunk, max_tokens_per_rank, num_chunks)
    with dispatching("hidden", hidden_TH, top_k, num_experts, ep_size, group_name,
                     max_tokens_per_rank, NORMAL) as comm:
        # The windows are copies of the allocator's (`window_rows` pads): DeepEP reads them
        # after this op returns, when the graph's own buffers may hold other data.
        ids_WK = window_rows(topk_ids_TK, *window, fill=-1)
        x_NH, ids_NK, weights_NK, handle = normal.send(
            comm, window_rows(hidden_TH, *window), window_rows(topk_weights_TK, *window),
            ids_WK, async_finish=True)
        comm.in_flight[chunk] = handle
        # Allocated on this stream, written behind DeepEP's kernels on theirs.
        routing_NX = torch.empty((x_NH.shape[0], 2 * top_k), dtype=torch.int32,
                                 device=x_NH.device)
        with _on_comm_stream(comm, x_NH.device):
            global_NK = torch.where(ids_NK >= 0, ids_NK + comm.rank * comm.num_local_experts,
                                    -1)
            routing_NX.copy_(routing_columns(global_NK, weights_NK))
            _arriving(x_NH.device, x_NH, routing_NX)
        return x_NH, routing_NX


def combine_tokens_start(y_NH, topk_ids_TK, num_experts, ep_size, group_name,
                         max_tokens_per_rank, chunk, num_chunks):
    with answering("y_tokens", y_NH, topk_ids_TK.shape[1], num_experts, ep_size, group_name,
                   max_tokens_per_rank, NORMAL) as comm:
        handle = comm.in_flight.pop(chunk, None)
        if handle is None:
            raise RuntimeError(f"a2a backend 'deepep': combine_tokens_start of chunk {chunk} "
                               f"must answer a dispatch_tokens_start of that chunk on {comm!r}, "
                               f"which has none in flight (chunks in flight: "
                               f"{sorted(comm.in_flight)})")
        # DeepEP reads its input after this op returns, and the graph may give y_NH's
        # buffer to a later kernel by then: Inductor keeps a collective's input alive until
        # its wait, not a custom op's. The kernels read a copy of the allocator's instead,
        # which DeepEP's record_stream keeps from reuse until they are done.
        y_sent_NH = y_NH.clone(memory_format=torch.contiguous_format)
        combined_MH, _, _ = comm.buffer.combine(y_sent_NH, handle,
                                                config=comm.combine_config, async_finish=True)
        with _on_comm_stream(comm, y_NH.device):
            _arriving(y_NH.device, combined_MH)
        return combined_MH
