"""The tokens format in chunks, each transfer issued by one op and waited by another, so that
a graph can run one chunk's experts while another chunk's tokens travel.

Legend: T tokens (this rank's), H hidden size, K experts per token, E experts (all ranks),
P ranks (``ep_size``), M = ``max_tokens_per_rank`` of one chunk, N = P * M receive
positions of one chunk, C = ``num_chunks``.

Chunk ``chunk`` is the window of tokens ``[chunk * M, (chunk + 1) * M)`` of this rank's T
(T <= C * M; a window past T is empty, and still joins every collective). Per chunk, the
ops below do what `ops.tokens`' ``dispatch_tokens -> experts -> combine_tokens`` does with
M tokens, in four steps, each transfer left in flight between an issue and its wait
(``_c10d_functional.wait_tensor``, a node of the graph of its own)::

    x_in_flight, routing_in_flight = dispatch_tokens_start(h, w, ids, E, P, g, M, chunk, C)
    weights_NK, ids_NK = dispatch_tokens_finish(wait(routing_in_flight), E, P, g, M)
    y_NH = experts(wait(x_in_flight), weights_NK, ids_NK, ...)          # any experts backend
    out_MH = combine_tokens_finish(wait(combine_tokens_start(y_NH, ids, E, P, g, M, chunk, C)),
                                   ids, E, P, g, M, chunk, C)

and ``cat(out_MH of every chunk)[:T]`` is ``combine_tokens`` of the whole layer. The rows
and the routing travel in messages of their own (`common.transport.token_routing`'s one
message would need a copy out of it before the wait). A transport whose returned rows are
already each token's sum (``sums_at_home=False``: a reduce-scatter) defines no
``combine_tokens_finish``; ``combine_tokens_start`` then returns ``[M, H]``, rows past the
window's tokens zero. These ops carry no gradient: chunking serves inference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_moe_ops.ops import checks, rows, tokens
from torch_moe_ops.ops.library import OpContract

CHUNK_ARGS = "int chunk=0, int num_chunks=1"
DISPATCH_START_SCHEMA = ("(Tensor hidden, Tensor topk_weights, Tensor topk_ids, int num_experts, "
                         f"{rows.EP_ARGS}, {CHUNK_ARGS}) -> (Tensor x_in_flight, "
                         "Tensor routing_in_flight)")
DISPATCH_FINISH_SCHEMA = (f"(Tensor routing_tokens, int num_experts, {rows.EP_ARGS}) -> "
                          "(Tensor topk_weights_tokens, Tensor topk_ids_tokens)")
COMBINE_START_SCHEMA = (f"(Tensor y_tokens, Tensor topk_ids, int num_experts, {rows.EP_ARGS}, "
                        f"{CHUNK_ARGS}) -> Tensor")
COMBINE_FINISH_SCHEMA = (f"(Tensor returned, Tensor topk_ids, int num_experts, {rows.EP_ARGS}, "
                         f"{CHUNK_ARGS}) -> Tensor")


def window_rows(values_TX: torch.Tensor, chunk: int, max_tokens_per_rank: int,
                num_chunks: int, fill: float = 0) -> torch.Tensor:
    """``[M, ...]``: chunk ``chunk``'s rows of ``values``, ``[chunk * M, (chunk + 1) * M)``,
    past T filled with ``fill`` (-1 for ids: no expert). Sliced from ``values`` padded to
    ``C * M`` rows, a size that does not depend on T: a window of a symbolic token count cut
    straight would guard T against its bounds and specialize it."""
    padding = num_chunks * max_tokens_per_rank - values_TX.shape[0]
    padded = F.pad(values_TX, (0, 0) * (values_TX.dim() - 1) + (0, padding), value=fill)
    return padded[chunk * max_tokens_per_rank:(chunk + 1) * max_tokens_per_rank]


def _check_chunk(chunk, num_chunks) -> None:
    if num_chunks < 1 or not 0 <= chunk < num_chunks:
        raise ValueError(f"chunk must be in [0, num_chunks) with num_chunks >= 1, got chunk="
                         f"{chunk}, num_chunks={num_chunks}")


def check_dispatch_start(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                         group_name="", max_tokens_per_rank=0, chunk=0, num_chunks=1) -> None:
    _check_chunk(chunk, num_chunks)
    # The layer's T must fit its C windows: the tokens format's checks on C * M tokens.
    tokens.check_dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size,
                          group_name, num_chunks * max_tokens_per_rank)


def fake_dispatch_start(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size=1,
                        group_name="", max_tokens_per_rank=0, chunk=0, num_chunks=1):
    positions = tokens.num_positions(ep_size, max_tokens_per_rank)
    return (hidden_TH.new_empty((positions, hidden_TH.shape[1])),
            hidden_TH.new_empty((positions, 2 * topk_ids_TK.shape[1]), dtype=torch.int32))


def check_dispatch_finish(routing_NX, num_experts, ep_size=1, group_name="",
                          max_tokens_per_rank=0) -> None:
    checks.check_tensor("routing_tokens", routing_NX, 2, (torch.int32,))
    rows.check_ep_args(ep_size, group_name, max_tokens_per_rank)
    tokens.check_experts_split(num_experts, ep_size)
    checks.check_size("routing_tokens", routing_NX, 0,
                      tokens.num_positions(ep_size, max_tokens_per_rank),
                      "ep_size * max_tokens_per_rank (N)")
    if routing_NX.shape[1] % 2:
        raise ValueError(f"routing_tokens.shape[1] must be 2 * top_k (ids, then weights), got "
                         f"{routing_NX.shape[1]}")


def fake_dispatch_finish(routing_NX, *_):
    shape = (routing_NX.shape[0], routing_NX.shape[1] // 2)
    return (routing_NX.new_empty(shape, dtype=torch.float32),
            routing_NX.new_empty(shape, dtype=torch.int32))


def check_combine_start(y_NH, topk_ids_TK, num_experts, ep_size=1, group_name="",
                        max_tokens_per_rank=0, chunk=0, num_chunks=1, name="y_tokens") -> None:
    _check_chunk(chunk, num_chunks)
    tokens.check_combine(y_NH, topk_ids_TK, num_experts, ep_size, group_name,
                         max_tokens_per_rank, name)
    if topk_ids_TK.shape[0] > num_chunks * max_tokens_per_rank:
        raise ValueError(f"topk_ids.shape[0] (tokens on this rank) must be <= num_chunks * "
                         f"max_tokens_per_rank ({num_chunks * max_tokens_per_rank}), got "
                         f"{topk_ids_TK.shape[0]}")


def fake_combine_start(sums_at_home: bool):
    """The fake of ``combine_tokens_start``: ``[N, H]`` where each token's rows come back to
    be summed at home (``combine_tokens_finish``), else ``[M, H]`` (already summed)."""

    def fake(y_NH, topk_ids_TK, num_experts, ep_size=1, group_name="", max_tokens_per_rank=0,
             *_):
        returned = y_NH.shape[0] if sums_at_home else max_tokens_per_rank
        return y_NH.new_empty((returned, y_NH.shape[1]))

    return fake


def check_combine_finish(returned_NH, topk_ids_TK, num_experts, ep_size=1, group_name="",
                         max_tokens_per_rank=0, chunk=0, num_chunks=1) -> None:
    check_combine_start(returned_NH, topk_ids_TK, num_experts, ep_size, group_name,
                        max_tokens_per_rank, chunk, num_chunks, "returned")


def fake_combine_finish(returned_NH, topk_ids_TK, num_experts, ep_size=1, group_name="",
                        max_tokens_per_rank=0, *_):
    return returned_NH.new_empty((max_tokens_per_rank, returned_NH.shape[1]))


_DISPATCH_START = OpContract(name="dispatch_tokens_start", schema=DISPATCH_START_SCHEMA,
                            check=check_dispatch_start, check_values=rows.check_dispatch_values,
                            fake=fake_dispatch_start, ordered=True)
_DISPATCH_FINISH = OpContract(name="dispatch_tokens_finish", schema=DISPATCH_FINISH_SCHEMA,
                             check=check_dispatch_finish, fake=fake_dispatch_finish)
_COMBINE_FINISH = OpContract(name="combine_tokens_finish", schema=COMBINE_FINISH_SCHEMA,
                            check=check_combine_finish, fake=fake_combine_finish)




def contracts(sums_at_home: bool) -> dict[str, OpContract]:
    """The contracts of a transport's chunked ops, by name: one that returns each position's
    rows to be summed at home (``sums_at_home``, with ``combine_tokens_finish``) or each
    token's sum (without it)."""
    combine_start = OpContract(name="combine_tokens_start", schema=COMBINE_START_SCHEMA,
                               check=check_combine_start,
                               fake=fake_combine_start(sums_at_home), ordered=True)
    chosen = (_DISPATCH_START, _DISPATCH_FINISH, combine_start,
              *((_COMBINE_FINISH,) if sums_at_home else ()))
    return {contract.name: contract for contract in chosen}

