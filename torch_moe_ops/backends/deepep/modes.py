"""Which of DeepEP's two modes runs a layer, and what each mode's kernels take.

The mode is fixed per layer when the layer is planned, from its sizes (`supports.mode_of`):
the masked format runs low-latency mode and the tokens format normal mode; the rows format
low-latency mode when ``M <= LOW_LATENCY_MAX_TOKENS`` (decode batches) and DeepEP's
low-latency kernels take the shape, normal otherwise (`chosen_mode`). The op schemas have no
mode: each mode's rows ops live in a namespace of their own (`ROWS_NAMESPACES`), which the
plan points the layer at, so an op runs its mode whatever communicators are open.
Legend: P ranks, H hidden size, K experts per token, M = max_tokens_per_rank.
"""

from __future__ import annotations

import os

import torch

from torch_moe_ops import quant
from torch_moe_ops.config import QuantSpec

NORMAL, LOW_LATENCY = "normal", "low_latency"
MODES = ("auto", NORMAL, LOW_LATENCY)
# The backend's namespace: normal mode's rows and tokens, low-latency mode's masked blocks.
NAMESPACE = "moe_deepep"
# Where each mode's rows ops live.
ROWS_NAMESPACES = {NORMAL: NAMESPACE, LOW_LATENCY: "moe_deepep_low_latency"}
# Decode batches up to this many tokens per rank take the low-latency kernels
# (DeepEP recommends < 256; their buffers grow as E * M * H).
LOW_LATENCY_MAX_TOKENS = 128
# What DeepEP's kernels are compiled for (csrc/kernels/launch.cuh, intranode.cu,
# internode.cu, internode_ll.cu at the measured commit).
GPUS_PER_HOST = 8
INTRANODE_RANKS = (2, 4, 8)
NORMAL_MAX_TOP_K = 32
NORMAL_MAX_LOCAL_EXPERTS = 1024
# Intranode dispatch stages half a bf16 token (H bytes) and an 8-byte mbarrier in 8 KiB
# of shared memory per warp (its TMA path, sm90 builds).
NORMAL_MAX_HIDDEN = 8176
# NVSHMEM's queue depth, which bounds the messages of one low-latency exchange.
NVSHMEM_QP_DEPTH_ENV = "NVSHMEM_QP_DEPTH"
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
LOW_LATENCY_MAX_TOP_K = 11
DTYPE = torch.bfloat16
# fp8 dispatch. DeepEP's buffer-size hints reserve this many fp32 scales per token
# (kNumMaxScales) in normal mode; its low-latency cast gives one scale per this many
# columns and needs the hidden size to be a multiple of LOW_LATENCY_FP8_HIDDEN_MULTIPLE.
NORMAL_MAX_SCALES = 128
LOW_LATENCY_FP8_GROUP = 128
LOW_LATENCY_FP8_HIDDEN_MULTIPLE = 512


def normal_mode_reason(ep_size: int | None, hidden_size: int | None, top_k: int | None,
                       num_local_experts: int | None) -> str | None:
    """Why DeepEP's normal kernels cannot run this shape (None: they can; None
    arguments are unknown and pass)."""
    if ep_size is not None and ep_size not in INTRANODE_RANKS:
        # Its dispatch runs with num_worst_tokens (a static receive size: it traces and
        # captures), which DeepEP's internode dispatch does not take.
        return (f"DeepEP's normal mode runs here on {INTRANODE_RANKS} ranks of one host only "
                f"(its static receive size, num_worst_tokens, is intranode-only in DeepEP), "
                f"got ep_size={ep_size}; over hosts, low-latency mode (max_tokens_per_rank <= "
                f"{LOW_LATENCY_MAX_TOKENS}) or a2a='all_to_all' runs")
    if hidden_size is not None and (hidden_size % 16 or hidden_size > NORMAL_MAX_HIDDEN):
        return (f"DeepEP's normal mode needs a hidden size that is a multiple of 16 and "
                f"<= {NORMAL_MAX_HIDDEN}, got {hidden_size}")
    if top_k is not None and top_k > NORMAL_MAX_TOP_K:
        return f"DeepEP's normal mode takes top_k <= {NORMAL_MAX_TOP_K}, got {top_k}"
    if num_local_experts is not None and num_local_experts > NORMAL_MAX_LOCAL_EXPERTS:
        return (f"DeepEP's normal mode takes <= {NORMAL_MAX_LOCAL_EXPERTS} experts per rank, "
                f"got {num_local_experts}")
    return None


def low_latency_mode_reason(ep_size: int | None, hidden_size: int | None, top_k: int | None,
                            max_tokens_per_rank: int | None) -> str | None:
    """Why DeepEP's low-latency kernels cannot run this shape (None: they can)."""
    if hidden_size is not None and hidden_size not in LOW_LATENCY_HIDDEN_SIZES:
        return (f"DeepEP's low-latency kernels are compiled for hidden sizes "
                f"{LOW_LATENCY_HIDDEN_SIZES}, got {hidden_size}")
    if top_k is not None and top_k > LOW_LATENCY_MAX_TOP_K:
        return f"DeepEP's low-latency kernels take top_k <= {LOW_LATENCY_MAX_TOP_K}, got {top_k}"
    if ep_size is not None and ep_size > GPUS_PER_HOST and ep_size % GPUS_PER_HOST:
        return (f"DeepEP runs more than {GPUS_PER_HOST} ranks only in hosts of "
                f"{GPUS_PER_HOST} GPUs, got ep_size={ep_size}")
    if (ep_size is not None and max_tokens_per_rank is not None
            and (ep_size * max_tokens_per_rank) % 4):
        return (f"DeepEP's low-latency kernels need ep_size * max_tokens_per_rank to be a "
                f"multiple of 4, got {ep_size} * {max_tokens_per_rank}")
    if max_tokens_per_rank is not None:
        depth = int(os.environ.get(NVSHMEM_QP_DEPTH_ENV, "1024"))
        if 2 * (max_tokens_per_rank + 1) > depth:
            return (f"DeepEP's low-latency mode needs NVSHMEM_QP_DEPTH >= 2 * "
                    f"(max_tokens_per_rank + 1) = {2 * (max_tokens_per_rank + 1)}, got {depth}")
    return None


def chosen_mode(ep_size: int | None, hidden_size: int | None, top_k: int | None,
                max_tokens_per_rank: int | None) -> tuple[str, str]:
    """``(mode, why)``: the mode a rows layer of this shape runs, low-latency for
    ``max_tokens_per_rank <= LOW_LATENCY_MAX_TOKENS`` where its kernels take the shape,
    normal otherwise."""
    if max_tokens_per_rank is None or max_tokens_per_rank > LOW_LATENCY_MAX_TOKENS:
        return NORMAL, (f"max_tokens_per_rank ({max_tokens_per_rank}) is not a decode size "
                        f"(<= {LOW_LATENCY_MAX_TOKENS})")
    reason = low_latency_mode_reason(ep_size, hidden_size, top_k, max_tokens_per_rank)
    if reason is not None:
        return NORMAL, f"low-latency mode cannot run it: {reason}"
    return LOW_LATENCY, (f"max_tokens_per_rank ({max_tokens_per_rank}) <= "
                         f"{LOW_LATENCY_MAX_TOKENS}: a decode size, which its kernels take")


def choose_mode(ep_size: int | None, hidden_size: int | None, top_k: int | None,
                max_tokens_per_rank: int | None) -> str:
    """The mode a rows layer of this shape runs (`chosen_mode`), which ``mode="auto"`` opens."""
    return chosen_mode(ep_size, hidden_size, top_k, max_tokens_per_rank)[0]


def fp8_transport_reason(mode: str, spec: QuantSpec, hidden_size: int) -> str | None:
    """Why the rows of ``moe::dispatch_quant`` (fp8 activations ``spec.activations``)
    travel in bf16 and are quantized on arrival in ``mode``; None where DeepEP's own fp8
    dispatch carries them (normal mode: the pair of values and scales; low-latency:
    DeepEP's cast). Either way the experts get fp8 rows and their scales."""
    if mode == NORMAL:
        num_scales = hidden_size // quant.activation_group(spec, hidden_size)
        if num_scales > NORMAL_MAX_SCALES:
            return (f"DeepEP's normal-mode buffers hold <= {NORMAL_MAX_SCALES} scales per "
                    f"token, {spec.activations} with block_size {spec.block_size} at hidden "
                    f"size {hidden_size} has {num_scales}")
        return None
    if spec.activations != "fp8_group" or spec.block_size[1] != LOW_LATENCY_FP8_GROUP:
        return (f"DeepEP's low-latency kernels quantize to fp8 themselves, with one scale per "
                f"{LOW_LATENCY_FP8_GROUP} columns only, and the experts read "
                f"{spec.activations} rows"
                + (f" of {spec.block_size[1]} columns per scale"
                   if spec.activations == "fp8_group" else ""))
    if hidden_size % LOW_LATENCY_FP8_HIDDEN_MULTIPLE:
        return (f"DeepEP's low-latency fp8 cast needs a hidden size that is a multiple of "
                f"{LOW_LATENCY_FP8_HIDDEN_MULTIPLE}, got {hidden_size}")
    return None


def mode_reason(mode, ep_size, hidden_size, top_k, num_local_experts, max_tokens_per_rank):
    """Why DeepEP's kernels of ``mode`` cannot run this shape (None: they can)."""
    if mode == LOW_LATENCY:
        return low_latency_mode_reason(ep_size, hidden_size, top_k, max_tokens_per_rank)
    return normal_mode_reason(ep_size, hidden_size, top_k, num_local_experts)

