"""What the ``flashinfer`` a2a backend can run and how big its workspace is: arithmetic
only, so that it is checked (and explained) without flashinfer or a GPU.

Legend: P ranks, M = max_tokens_per_rank, H hidden size, K experts per token, b bytes per
activation element.

Every rank holds one workspace, into which its peers write over NVLink:

    flashinfer's own region (counters, flags, each token's send slots: about 2 * M * 22 * 4 B)
    + pad128(P * M * dispatch bytes per token)   every rank's tokens, each received once
    + pad128(P * M * combine bytes per token)    each received token's result, sent back

with dispatch bytes per token = H * b (activations) + 4 * (K + 1) (int32 expert ids and the
token's index on its rank) + 4 * K (fp32 routing weights), and combine bytes per token = H * b.
flashinfer's ``moe_a2a_get_workspace_size_per_rank`` gives the exact total from these two
figures; `payload_bytes` is the part that grows with P * M, what decides whether it fits.
"""

from __future__ import annotations

import torch

# What the kernels are compiled for (SWITCH_TOP_K and kMaxRanks in
# csrc/nv_internal/tensorrt_llm/kernels/communicationKernels/moeAlltoAll*, flashinfer 0.7.2).
TOP_K_VALUES = (1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 22)
MAX_RANKS = 64
# What its combine sums (SWITCH_DTYPE): the activations travel in their own dtype.
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ALIGNMENT = 128
INDEX_BYTES = 4
WEIGHT_BYTES = 4
GIB = 1 << 30


def pad(num_bytes: int) -> int:
    """``num_bytes`` rounded up to flashinfer's 128-byte alignment of each region."""
    return -(-num_bytes // ALIGNMENT) * ALIGNMENT


def dispatch_bytes_per_token(hidden_size: int, top_k: int, dtype: torch.dtype) -> int:
    """Bytes of one token's dispatch payloads: activations, ids + token index, weights."""
    return hidden_size * dtype.itemsize + INDEX_BYTES * (top_k + 1) + WEIGHT_BYTES * top_k


def combine_bytes_per_token(hidden_size: int, dtype: torch.dtype) -> int:
    """Bytes of one received token's result: ``[H]`` in the activation dtype."""
    return hidden_size * dtype.itemsize


def payload_bytes(ep_size: int, max_tokens_per_rank: int, hidden_size: int, top_k: int,
                  dtype: torch.dtype) -> int:
    """The receive and combine regions of one rank's workspace, in bytes."""
    positions = ep_size * max_tokens_per_rank
    return (pad(positions * dispatch_bytes_per_token(hidden_size, top_k, dtype))
            + pad(positions * combine_bytes_per_token(hidden_size, dtype)))


def largest_max_tokens(free_bytes: int, ep_size: int, hidden_size: int, top_k: int,
                       dtype: torch.dtype) -> int:
    """The largest ``max_tokens_per_rank`` whose payload regions fit in ``free_bytes``."""
    per_position = (dispatch_bytes_per_token(hidden_size, top_k, dtype)
                    + combine_bytes_per_token(hidden_size, dtype))
    tokens = free_bytes // (ep_size * per_position)
    # The regions' padding may take the last one back.
    while tokens > 0 and payload_bytes(ep_size, tokens, hidden_size, top_k, dtype) > free_bytes:
        tokens -= 1
    return tokens


def why_not_fits(workspace_bytes: int, available_bytes: int, ep_size: int,
                 max_tokens_per_rank: int, hidden_size: int, top_k: int, dtype: torch.dtype,
                 available: str = "free") -> str | None:
    """Why a workspace of ``workspace_bytes`` per rank does not fit in ``available_bytes`` of
    GPU memory (``available``: "free", or "in all" for the GPU's whole memory), saying how
    to lower it; None where it fits."""
    if workspace_bytes <= available_bytes:
        return None
    fits = largest_max_tokens(available_bytes, ep_size, hidden_size, top_k, dtype)
    return (f"its workspace needs {workspace_bytes / GIB:.2f} GiB per rank ({ep_size} ranks x "
            f"max_tokens_per_rank {max_tokens_per_rank} x "
            f"{dispatch_bytes_per_token(hidden_size, top_k, dtype)} B dispatched + "
            f"{combine_bytes_per_token(hidden_size, dtype)} B combined per token, H="
            f"{hidden_size}, K={top_k}, {dtype}), but the GPU has {available_bytes / GIB:.2f} "
            f"GiB {available}: lower MoEConfig.max_tokens_per_rank (at most about {fits} fits) or "
            "split the batch")


def why_not_shape(ep_size: int | None, top_k: int | None, dtype: torch.dtype | None,
                  num_experts: int | None = None, hidden_size: int | None = None) -> str | None:
    """Why the kernels cannot run this shape (None: they can; None arguments are unknown)."""
    if ep_size is not None and ep_size > MAX_RANKS:
        return f"FlashInfer's MoE all-to-all runs at most {MAX_RANKS} ranks, got ep_size={ep_size}"
    if top_k is not None and top_k not in TOP_K_VALUES:
        return (f"FlashInfer's MoE all-to-all is compiled for top_k in {TOP_K_VALUES}, got "
                f"{top_k}")
    if dtype is not None and dtype not in DTYPES:
        return (f"FlashInfer's MoE all-to-all moves {', '.join(map(str, DTYPES))} activations, "
                f"got {dtype}")
    if num_experts is not None and ep_size is not None and num_experts < ep_size:
        return f"needs at least one expert per rank, got {num_experts} experts on {ep_size} ranks"
    # The int32 and fp32 payloads follow the activations' [P, M, H] in the workspace.
    if hidden_size is not None and dtype is not None and hidden_size * dtype.itemsize % 4:
        return (f"needs hidden_size * bytes per element to be a multiple of 4 (the payloads "
                f"after the activations hold 4-byte values), got H={hidden_size} in {dtype}")
    return None

