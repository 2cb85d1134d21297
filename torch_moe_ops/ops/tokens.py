"""The tokens format: what an a2a backend hands an experts backend's ``experts`` op
when the two form a fused pair (`backends.registry.Registry.register_fused`).

Legend: T tokens (this rank's), H hidden size, K experts per token, E experts (all
ranks), P ranks (``ep_size``), M = ``max_tokens_per_rank``, N = P * M receive positions.

``dispatch_tokens`` sends each token to the ranks that hold its experts and returns, there,
the receive buffers as they are: ``x_tokens [N, H]`` (position ``p * M + i``: the i-th token
that came from rank ``p``, in the order it came), its routing weights ``[N, K]`` (fp32) and
its expert ids translated to this rank's experts ``[N, K]`` (int32; -1 for an expert of
another rank, for a skipped slot and for every slot of a position no token came to). That is
``moe::experts``' input, so the experts backend's own op reads the buffers with no copy into
rows, and gives each received token's weighted sum over this rank's experts; ``combine_tokens``
sends those back and sums each token's over the ranks it went to:

    combine_tokens(experts(*dispatch_tokens(h, w, ids), w13, ...), ids) == experts(h, w, ids)

Both carry the layer's static expert-parallel arguments like ``moe::dispatch``;
``combine_tokens`` takes this rank's ``topk_ids`` for T and K. They serve inference: the
buffers may be the transport's own memory, which the next dispatch overwrites, so no gradient
can keep them (asking for one raises), and a layer that trains takes the rows format. Every
rank calls both, with 0 tokens too; a backend's combine answers the dispatch before it.
"""

from __future__ import annotations

import torch

from torch_moe_ops.config import worst_case_capacity
from torch_moe_ops.ops import checks, rows
from torch_moe_ops.ops.library import OpContract
from torch_moe_ops.ops.quant import no_gradient_autograd

DISPATCH_SCHEMA = ("(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                   f"{rows.EP_ARGS}) -> (Tensor x_tokens, Tensor topk_weights_tokens, "
                   "Tensor topk_ids_tokens)")
COMBINE_SCHEMA = f"(Tensor y_tokens, Tensor topk_ids, {rows.EP_ARGS}) -> Tensor"


def num_positions(ep_size: int, max_tokens_per_rank: int) -> int:
    """N: the receive positions of one rank."""
    return ep_size * max_tokens_per_rank


def check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                   group_name="", max_tokens_per_rank=0) -> None:
    rows.check_ep_args(ep_size, group_name, max_tokens_per_rank)
    # The rows format's checks with the largest capacity: the same arguments, the same errors.
    rows.check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
                        group_name, max_tokens_per_rank,
                        worst_case_capacity(max_tokens_per_rank, topk_ids_TK.shape[1],
                                            num_experts // ep_size))
    # Rows check it only across ranks; the receive buffers have M positions per rank, one too.
    rows.check_tokens_fit(hidden_TH, max_tokens_per_rank)


def fake_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                  group_name="", max_tokens_per_rank=0):
    positions = num_positions(ep_size, max_tokens_per_rank)
    top_k = topk_ids_TK.shape[1]
    return (hidden_TH.new_empty((positions, hidden_TH.shape[1])),
            hidden_TH.new_empty((positions, top_k), dtype=torch.float32),
            hidden_TH.new_empty((positions, top_k), dtype=torch.int32))


def check_combine(y_NH, topk_ids_TK, ep_size=1, group_name="", max_tokens_per_rank=0) -> None:
    checks.check_tensor("y_tokens", y_NH, 2, checks.FLOAT_DTYPES)
    checks.check_tensor("topk_ids", topk_ids_TK, 2, checks.INDEX_DTYPES)
    rows.check_ep_args(ep_size, group_name, max_tokens_per_rank)
    checks.check_size("y_tokens", y_NH, 0, num_positions(ep_size, max_tokens_per_rank),
                      "ep_size * max_tokens_per_rank (N)")
    checks.check_same_device("y_tokens", y_NH, topk_ids=topk_ids_TK)


def fake_combine(y_NH, topk_ids_TK, *_):
    return y_NH.new_empty((topk_ids_TK.shape[0], y_NH.shape[1]))


_setup_dispatch, _dispatch_backward = no_gradient_autograd("dispatch_tokens")
_setup_combine, _combine_backward = no_gradient_autograd("combine_tokens")
DISPATCH = OpContract(name="dispatch_tokens", schema=DISPATCH_SCHEMA, check=check_dispatch,
                      check_values=rows.check_dispatch_values,
                      fake=fake_dispatch, backward=_dispatch_backward,
                      setup_context=_setup_dispatch, ordered=True)
COMBINE = OpContract(name="combine_tokens", schema=COMBINE_SCHEMA, check=check_combine,
                     fake=fake_combine, backward=_combine_backward, setup_context=_setup_combine,
                     ordered=True)
CONTRACTS = {contract.name: contract for contract in (DISPATCH, COMBINE)}
