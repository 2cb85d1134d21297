"""Where the tokens format puts each token (`common.transport.token_positions.send_positions`):
the positions, and the shape of the graph that computes them.

Legend: T tokens of one rank, K experts per token, E experts, P ranks, M max tokens per rank.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from torch_moe_ops.backends.common.transport.token_positions import send_positions


def _expected_positions(ids_TK: torch.Tensor, num_experts: int, num_ranks: int,
                        max_tokens: int) -> tuple[list[list[int]], list[int]]:
    """Token by token: the j-th token that chose one of rank p's experts at ``p * M + j``."""
    send_TP = [[-1] * num_ranks for _ in range(ids_TK.shape[0])]
    token_N = [-1] * (num_ranks * max_tokens)
    for rank in range(num_ranks):
        count = 0
        for token, ids in enumerate(ids_TK.tolist()):
            if any(i >= 0 and i // (num_experts // num_ranks) == rank for i in ids):
                send_TP[token][rank] = rank * max_tokens + count
                token_N[rank * max_tokens + count] = token
                count += 1
    return send_TP, token_N


@pytest.mark.parametrize("num_ranks", [1, 2, 3, 4])
@pytest.mark.parametrize("num_tokens", [0, 1, 7])
def test_send_positions_put_each_ranks_tokens_in_token_order(num_ranks, num_tokens):
    """Skipped slots, repeated ids, an idle rank and padding after the last token."""
    K, E, M = 3, 4 * num_ranks, 9
    gen = torch.Generator().manual_seed(num_ranks * 10 + num_tokens)
    ids_TK = torch.randint(-1, E, (num_tokens, K), generator=gen, dtype=torch.int32)
    if num_tokens:
        ids_TK[0] = torch.tensor([2, 2, -1])
    send_position_TP, token_of_position_N = send_positions(ids_TK, E, num_ranks, M)
    expected_TP, expected_N = _expected_positions(ids_TK, E, num_ranks, M)
    assert send_position_TP.dtype == torch.int32 and send_position_TP.is_contiguous()
    assert send_position_TP.tolist() == expected_TP
    assert token_of_position_N.tolist() == expected_N


def test_send_positions_scan_the_flags_of_all_ranks_as_one_axis():
    """The running count is one scan of a 1-D tensor: Inductor (torch 2.11) splits a scan
    down T of a ``[T, P]`` buffer over blocks of T in a kernel that has no axis for the
    rank, and cannot generate it once it computes the rank there (a training graph on 2
    GPUs failed so: "list indices must be integers or slices, not NoneType")."""
    ids_TK = torch.randint(0, 64, (4096, 8), dtype=torch.int32)
    graph = make_fx(lambda ids: send_positions(ids, 64, 2, 4096))(ids_TK).graph
    scans = [node for node in graph.nodes if node.target == torch.ops.aten.cumsum.default]
    assert scans
    for scan in scans:
        assert scan.args[0].meta["val"].dim() == 1, scan.format_node()
