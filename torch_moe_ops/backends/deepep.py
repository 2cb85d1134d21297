"""The ``deepep`` a2a backend: DeepEP's expert-parallel kernels (NVLink, RDMA) behind
``moe::dispatch``, ``moe::dispatch_quant``, ``moe::combine`` and their gradients, on its
public ``deep_ep.Buffer`` API.

Legend: T tokens on this rank, T1 = max(T, 1) tokens handed to DeepEP, M =
max_tokens_per_rank, H hidden size, K experts per token, E experts, E_l = E / P
experts per rank, P ranks, C rows one rank may send another (the capacity), R = P * C
rows, N = P * M tokens one rank can receive (normal mode), Q = P * M positions per
expert and L = E_l * Q (low-latency mode), G = P * M tokens of all ranks, token ``t``
of rank ``p`` having the key ``p * M + t``; A fp8 scales per row (1 for ``fp8_token``,
H / block_size[1] for ``fp8_group``).

The mode is fixed per layer by its static arguments (the op schema has no mode):
low-latency when ``M <= LOW_LATENCY_MAX_TOKENS`` (decode batches) and DeepEP's
low-latency kernels take the shape (`LOW_LATENCY_HIDDEN_SIZES`, K <= 11), normal
otherwise (prefill, training). `communicator` (mode=...) fixes it by hand: call it on
every rank before the layer's first call.

Normal mode (``Buffer.get_dispatch_layout`` + ``Buffer.dispatch(num_worst_tokens=N)``):
every rank receives a worst-case-sized ``[N, H]`` block (tokens that came, then
padding whose ids DeepEP sets to -1), so no size depends on the routing and nothing
waits on the host. Received ``(token, local slot)`` pairs are sorted by local expert
into rows (`common.kernels.sorting`); ``src_R`` is each row's received slot ``n * K + k``.
Combine weights the rows, sums each received token's rows in slot order
(``[N, H]``) and hands them to ``Buffer.combine``, which sums each token over the
ranks that hold its experts. DeepEP's handle (prefix matrices, send heads: tensors
whose sizes the op contract cannot carry) stays in the `DeepEPCommunicator`, keyed
by the storage of the ``src_rows`` tensor that dispatch returned, and is dropped
when that storage is freed: combine and both gradients must get that very tensor
(as they do eagerly, under ``torch.compile`` and in one captured CUDA graph; a copy,
as ``torch.library.opcheck`` makes, finds no handle and raises). The
gradient of dispatch is ``Buffer.combine`` (the routing weights' gradients ride as
its ``topk_weights``), the gradient of combine a cached-handle ``Buffer.dispatch``.

Low-latency mode (``Buffer.low_latency_dispatch`` / ``low_latency_combine``, bf16):
DeepEP delivers ``[E_l, Q, H]`` plus a device-side count per expert; the rows of
expert ``e`` sit at ``e * Q`` and the padding between experts breaks the rows
layout (``grouped_mm`` takes offsets ``cumsum(count)``, and ``L > R`` when ``K <
E_l``), so dispatch compacts them with one gather, ordered by (expert, key): the
order does not depend on the order messages arrived in. DeepEP does not carry the
routing weights, so dispatch all-gathers every rank's ids and weights (``[G, 2K]``
int32, small at decode sizes) and reads each row's weight there. ``src_R`` is
``e * Q + key`` and ``slot_map_TK`` this rank's global expert ids: combine rebuilds
DeepEP's handle (``src_info``, ``layout_range``) from them, so this mode keeps no
state between ops. The gradient of dispatch is ``low_latency_combine`` plus one
``all_to_all`` of ``[G, E_l]`` routing-weight gradients; the gradient of combine a
second ``low_latency_dispatch``, whose rows are matched by (expert, key).

Both modes: static shapes, no host sync (unless ``ep_capacity`` is below the worst
case: then dispatch checks, with one all-reduce and a host read, that no rank sends
another more than ``C`` rows, and raises on all of them if one does), so no op
needs the ``cudagraph_unsafe`` tag: a layer captures in a CUDA graph in either mode
(DeepEP's low-latency kernels alternate between two buffers; each captured
dispatch/combine pair keeps that parity). An idle rank hands DeepEP one row routed
nowhere (ids -1), so no kernel sees an empty tensor, and joins every collective.
The four ops carry an ordered effect: ``torch.compile`` neither drops one whose
outputs are empty (an idle rank's ``[0, H]``) nor moves it past another, so every
rank runs them in the same order.

State: one `DeepEPCommunicator` per (group, H, E, K, M, dtype) holds the
``deep_ep.Buffer``, sized from DeepEP's hints (``Config.get_nvl_buffer_size_hint``
and ``get_rdma_buffer_size_hint`` of the dispatch and combine configs; low-latency:
``Buffer.get_low_latency_rdma_size_hint(M, H, P, E)``), created once, outside CUDA
graph capture (the first eager call creates it, collectively), kept in this module's
one keyed cache and released by ``close()`` / `close_all()` (collective: call them on
every rank). Low-latency mode and groups over several hosts initialise NVSHMEM, which
a process holds once: one such communicator at a time. Creating a ``Buffer`` sets
DeepEP's ``NVSHMEM_*`` environment variables (DeepEP does that, this module does not).

Over several hosts (P > 8, 8 GPUs per host, as DeepEP's internode kernels assume)
the same calls run DeepEP's internode kernels (``num_rdma_bytes > 0``, RDMA through
NVSHMEM/IBGDA); that path is written against DeepEP's API but has not been run here.
Routing must give each token distinct experts (as top-k does) in low-latency mode.

fp8 dispatch (``moe::dispatch_quant``, where the dispatch dtype rule picks fp8: a
quantized layer's fp8 activations, experts that read fp8 rows): the rows reach the
experts in float8_e4m3fn with their fp32 scales (``x_scale``: ``[R]`` for
``fp8_token``, ``[R, A]`` for ``fp8_group``); combine and the gradients stay bf16
(quantized layers have none: ``moe::dispatch_quant`` raises when asked).

- Normal mode: each token is quantized once, before it leaves
  (`quant.quantize_activations`, the oracle's formula, in the format the experts
  read), and ``Buffer.dispatch`` moves DeepEP's fp8 pair ``(x [T, H] e4m3, scales
  [T, A] fp32)``: DeepEP copies ``scales.size(1)`` floats per token beside its row,
  so each received row keeps its scales. The rows are bit for bit those of dispatch
  then quantize.
- Low-latency mode: DeepEP quantizes inside ``low_latency_dispatch(use_fp8=True)``,
  with one scale per 128 columns only, so ``fp8_group`` with ``block_size[1] == 128``
  travels in fp8 there. Its cast, ``fp8(x * (448 / amax))`` with amax at least 1e-4 and
  scale ``amax * fp32(1 / 448)``, is ours (``fp8(x / (amax / 448))``, amax at least
  1e-12) up to fp32 rounding, not bit for bit: an element lands one e4m3 step away
  where ``x / scale`` falls within an fp32 ulp of a rounding boundary, a scale one ulp
  away, and a group whose largest magnitude is below 1e-4 gets a coarser scale. Its
  scales come column-major (``[E_l, Q, A]`` over ``[E_l, A, Q]`` storage) and are
  gathered with their rows.
- Where DeepEP's fp8 path does not take the format (`fp8_transport_reason`:
  ``fp8_token`` or another group width in low-latency mode; more than
  `NORMAL_MAX_SCALES` scales per token in normal mode, which DeepEP's buffer hints do
  not reserve), rows travel in bf16 and are quantized on arrival: a row is a copy of
  its token, so they get the values quantizing before would give, in twice the bytes.

A communicator sized for bf16 rows holds an fp8 row and its scales: one serves both.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import weakref

import torch
import torch.distributed as dist

from torch_moe_ops import quant
from torch_moe_ops.backends.common.kernels.rows import (
    block_of,
    combine_grads,
    gather_index,
    gather_rows,
    scatter_index,
    scatter_rows,
    sum_slots,
    weighted_rows,
)
from torch_moe_ops.backends.common.kernels.sorting import sort_rows
from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.common.transport.communicators import Communicators
from torch_moe_ops.backends.registry import REGISTRY, A2ABackend
from torch_moe_ops.config import QuantSpec, worst_case_capacity
from torch_moe_ops.ops import define_backend_ops

NAMESPACE = "moe_deepep"
NOT_INSTALLED = ("DeepEP is not installed: build it from source (python -m "
                 "torch_moe_ops.backends.install deepep says how); PyPI's deep_ep has no kernels")
NORMAL, LOW_LATENCY = "normal", "low_latency"
MODES = ("auto", NORMAL, LOW_LATENCY)
# Decode batches up to this many tokens per rank take the low-latency kernels
# (DeepEP recommends < 256; their buffers grow as E * M * H).
LOW_LATENCY_MAX_TOKENS = 128
# What DeepEP's kernels are compiled for (csrc/kernels/launch.cuh, intranode.cu,
# internode.cu, internode_ll.cu at the measured commit).
GPUS_PER_HOST = 8
INTRANODE_RANKS = (2, 4, 8)
INTERNODE_RANKS = (16, 24, 32, 48, 64, 96, 128, 144, 160)
NORMAL_MAX_TOP_K = 32
NORMAL_MAX_LOCAL_EXPERTS = 1024
# Intranode dispatch stages half a bf16 token (H bytes) and an 8-byte mbarrier in 8 KiB
# of shared memory per warp (its TMA path, sm90 builds).
NORMAL_MAX_HIDDEN = 8176
LOW_LATENCY_HIDDEN_SIZES = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
LOW_LATENCY_MAX_TOP_K = 11
DTYPE = torch.bfloat16
# fp8 dispatch. DeepEP's buffer-size hints reserve this many fp32 scales per token
# (kNumMaxScales) in normal mode; its low-latency cast gives one scale per this many
# columns and needs the hidden size to be a multiple of LOW_LATENCY_FP8_HIDDEN_MULTIPLE.
NORMAL_MAX_SCALES = 128
LOW_LATENCY_FP8_GROUP = 128
LOW_LATENCY_FP8_HIDDEN_MULTIPLE = 512


def _import_deep_ep():
    """``deep_ep``, or the reason it cannot be used."""
    try:
        deep_ep = importlib.import_module("deep_ep")
        for name in ("Buffer", "Config", "topk_idx_t"):
            getattr(deep_ep, name)
    except ModuleNotFoundError as error:
        if error.name == "deep_ep":
            return None, NOT_INSTALLED
        return None, f"{NOT_INSTALLED} (import deep_ep failed: {error})"
    except (ImportError, AttributeError, OSError) as error:
        return None, f"{NOT_INSTALLED} (import deep_ep failed: {error})"
    return deep_ep, None


def _deep_ep():
    deep_ep, reason = _import_deep_ep()
    if reason is not None:
        raise RuntimeError(f"a2a backend 'deepep': {reason}")
    return deep_ep


def normal_mode_reason(ep_size: int | None, hidden_size: int | None, top_k: int | None,
                       num_local_experts: int | None) -> str | None:
    """Why DeepEP's normal kernels cannot run this shape (None: they can; None
    arguments are unknown and pass)."""
    if ep_size is not None and ep_size not in INTRANODE_RANKS + INTERNODE_RANKS:
        return (f"DeepEP's normal mode runs on {INTRANODE_RANKS} ranks of one host or "
                f"{INTERNODE_RANKS} ranks over hosts of {GPUS_PER_HOST} GPUs, got "
                f"ep_size={ep_size}")
    if hidden_size is not None:
        if hidden_size % 16 or hidden_size > NORMAL_MAX_HIDDEN:
            return (f"DeepEP's normal mode needs a hidden size that is a multiple of 16 and "
                    f"<= {NORMAL_MAX_HIDDEN}, got {hidden_size}")
        if ep_size is not None and ep_size > GPUS_PER_HOST and hidden_size % 256:
            return (f"DeepEP's internode combine needs a hidden size that is a multiple of "
                    f"256, got {hidden_size}")
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
        depth = int(os.environ.get("NVSHMEM_QP_DEPTH", "1024"))
        if 2 * (max_tokens_per_rank + 1) > depth:
            return (f"DeepEP's low-latency mode needs NVSHMEM_QP_DEPTH >= 2 * "
                    f"(max_tokens_per_rank + 1) = {2 * (max_tokens_per_rank + 1)}, got {depth}")
    return None


def choose_mode(ep_size: int | None, hidden_size: int | None, top_k: int | None,
                max_tokens_per_rank: int | None) -> str:
    """The mode ``mode="auto"`` takes: low-latency for ``max_tokens_per_rank <=
    LOW_LATENCY_MAX_TOKENS`` where its kernels take the shape, normal otherwise."""
    if (max_tokens_per_rank is not None and max_tokens_per_rank <= LOW_LATENCY_MAX_TOKENS
            and low_latency_mode_reason(ep_size, hidden_size, top_k, max_tokens_per_rank)
            is None):
        return LOW_LATENCY
    return NORMAL


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


def _mode_reason(mode, ep_size, hidden_size, top_k, num_local_experts, max_tokens_per_rank):
    if mode == LOW_LATENCY:
        return low_latency_mode_reason(ep_size, hidden_size, top_k, max_tokens_per_rank)
    return normal_mode_reason(ep_size, hidden_size, top_k, num_local_experts)


def _on(device: torch.device):
    """``device`` current (DeepEP allocates and launches on the current CUDA device)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """What one normal-mode dispatch leaves for its combine and gradients."""

    handle: tuple
    storage: weakref.ref


def _forget(handles: dict, address: int, entry: _Dispatched) -> None:
    if handles.get(address) is entry:
        del handles[address]


class DeepEPCommunicator:
    """DeepEP's state for one layer shape on one process group: the ``deep_ep.Buffer``
    (sized for ``mode`` from DeepEP's hints, allocated once), its configs, and the
    normal-mode handles of the dispatches whose ``src_rows`` are still alive.

    Build it with `communicator` (which caches it); ``close()`` releases the buffer
    (collective: every rank of the group calls it).
    """

    def __init__(self, group_name: str, hidden_size: int, num_experts: int, top_k: int,
                 max_tokens_per_rank: int, dtype: torch.dtype, mode: str,
                 device: torch.device) -> None:
        deep_ep = _deep_ep()
        group = collectives.group_of(group_name)
        self.group_name, self.ep_size, self.rank = group_name, group.size(), group.rank()
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.max_tokens_per_rank, self.dtype, self.mode = max_tokens_per_rank, dtype, mode
        self.device = device
        self.num_local_experts = num_experts // self.ep_size
        self.topk_idx_dtype = deep_ep.topk_idx_t
        self.handles: dict[int, _Dispatched] = {}
        buffer_cls = deep_ep.Buffer
        normal = mode == NORMAL
        self.dispatch_config = buffer_cls.get_dispatch_config(self.ep_size) if normal else None
        self.combine_config = buffer_cls.get_combine_config(self.ep_size) if normal else None
        with _on(device):
            if mode == LOW_LATENCY:
                num_nvl_bytes = 0
                num_rdma_bytes = buffer_cls.get_low_latency_rdma_size_hint(
                    max_tokens_per_rank, hidden_size, self.ep_size, num_experts)
                # DeepEP: one queue pair per local expert.
                num_qps = self.num_local_experts
            else:
                hidden_bytes = hidden_size * max(dtype.itemsize, 2)
                configs = (self.dispatch_config, self.combine_config)
                num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, self.ep_size)
                                    for c in configs)
                num_rdma_bytes = max(c.get_rdma_buffer_size_hint(hidden_bytes, self.ep_size)
                                     for c in configs)
                num_qps = buffer_cls.num_sms if num_rdma_bytes > 0 else 1
            self.uses_nvshmem = num_rdma_bytes > 0
            self.buffer = buffer_cls(group, num_nvl_bytes, num_rdma_bytes,
                                     low_latency_mode=mode == LOW_LATENCY,
                                     num_qps_per_rank=num_qps,
                                     allow_nvlink_for_low_latency_mode=True,
                                     explicitly_destroy=True)

    def __repr__(self) -> str:
        state = "closed" if self.buffer is None else "open"
        return (f"DeepEPCommunicator(group={self.group_name!r}, mode={self.mode!r}, "
                f"H={self.hidden_size}, E={self.num_experts}, K={self.top_k}, "
                f"max_tokens_per_rank={self.max_tokens_per_rank}, {state})")

    def matches(self, group_name, hidden_size, top_k, max_tokens_per_rank, dtype) -> bool:
        return (self.group_name, self.hidden_size, self.top_k, self.max_tokens_per_rank,
                self.dtype) == (group_name, hidden_size, top_k, max_tokens_per_rank, dtype)

    def check_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.max_tokens_per_rank:
            raise ValueError(f"tokens on this rank must be <= max_tokens_per_rank "
                             f"({self.max_tokens_per_rank}), which sized DeepEP's buffers, got "
                             f"{num_tokens}")

    def remember(self, src_R: torch.Tensor, handle: tuple) -> None:
        """Keep a normal-mode ``handle`` for as long as ``src_R``'s storage lives."""
        storage = src_R.untyped_storage()
        address = storage.data_ptr()
        entry = _Dispatched(handle, weakref.ref(storage))
        self.handles[address] = entry
        weakref.finalize(storage, _forget, self.handles, address, entry).atexit = False

    def recall(self, src_R: torch.Tensor) -> tuple | None:
        storage = src_R.untyped_storage()
        entry = self.handles.get(storage.data_ptr())
        if entry is None or entry.storage() is not storage:
            return None
        return entry.handle

    def close(self) -> None:
        """Release DeepEP's buffer (collective: every rank of the group calls it)."""
        if self.buffer is None:
            return
        self.handles.clear()
        with _on(self.device):
            self.buffer.destroy()
        self.buffer = None
        key = _key(self.group_name, self.hidden_size, self.num_experts, self.top_k,
                   self.max_tokens_per_rank, self.dtype)
        _COMMUNICATORS.forget(key, self)


# The one cache of this module: open communicators by (group, H, E, K, M, dtype).
# `communicator` fills it, `DeepEPCommunicator.close` and `close_all` empty it.
_COMMUNICATORS = Communicators()


def _key(group_name, hidden_size, num_experts, top_k, max_tokens_per_rank, dtype) -> tuple:
    return (group_name, hidden_size, num_experts, top_k, max_tokens_per_rank, str(dtype))


def communicator(group_name: str, hidden_size: int, num_experts: int, top_k: int,
                 max_tokens_per_rank: int, dtype: torch.dtype = DTYPE, mode: str = "auto",
                 device: torch.device | str | None = None) -> DeepEPCommunicator:
    """The communicator of this layer shape on group ``group_name``, created on first use.

    Creating one is collective (DeepEP exchanges buffer handles over the group) and
    cannot happen inside CUDA graph capture: every rank calls this, or runs the
    layer once eagerly, before capturing. ``mode`` ("auto", "normal",
    "low_latency") fixes the mode; "auto" is `choose_mode`.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    key = _key(group_name, hidden_size, num_experts, top_k, max_tokens_per_rank, dtype)
    existing = _COMMUNICATORS.get(key)
    if existing is not None:
        if mode not in ("auto", existing.mode):
            raise ValueError(f"mode must be {existing.mode!r} (the open {existing!r}), got "
                             f"{mode!r}: close it on every rank first")
        return existing
    if dtype != DTYPE:
        raise ValueError(f"dtype must be {DTYPE} (DeepEP moves bf16 activations), got {dtype}")
    ep_size = collectives.group_of(group_name).size()
    if num_experts % ep_size:
        raise ValueError(f"num_experts must be divisible by the group size ({ep_size}), got "
                         f"{num_experts}")
    if mode == "auto":
        mode = choose_mode(ep_size, hidden_size, top_k, max_tokens_per_rank)
    reason = _mode_reason(mode, ep_size, hidden_size, top_k, num_experts // ep_size,
                          max_tokens_per_rank)
    if reason is not None:
        raise ValueError(f"a2a backend 'deepep' cannot run mode {mode!r} here: {reason}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the DeepEP communicator of group {group_name!r} (H={hidden_size}, "
                           f"E={num_experts}, K={top_k}, max_tokens_per_rank="
                           f"{max_tokens_per_rank}) must be created before CUDA graph capture: "
                           "run the layer once eagerly, or call "
                           "torch_moe_ops.backends.deepep.communicator(...) on every rank first")
    if mode == LOW_LATENCY or ep_size > GPUS_PER_HOST:
        holder = next((c for c in _COMMUNICATORS.values() if c.uses_nvshmem), None)
        if holder is not None:
            raise RuntimeError(f"DeepEP's {mode} mode on {ep_size} ranks initialises NVSHMEM, "
                               f"which this process already holds for {holder!r}: one such "
                               "communicator per process; close it (on every rank) first")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    created = DeepEPCommunicator(group_name, hidden_size, num_experts, top_k,
                                 max_tokens_per_rank, dtype, mode, torch.device(device))
    _COMMUNICATORS[key] = created
    return created


close_all = _COMMUNICATORS.close_all
open_communicators = _COMMUNICATORS.in_key_order


def _check_tensor(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be on a CUDA device for a2a backend 'deepep', got "
                         f"{t.device}")
    if t.dtype != DTYPE:
        raise ValueError(f"{name} must be {DTYPE} for a2a backend 'deepep' (DeepEP moves bf16 "
                         f"activations), got {t.dtype}: run the layer in bfloat16 or choose "
                         "another a2a backend")


def _pad_tokens(t_TX: torch.Tensor, num_rows: int, fill) -> torch.Tensor:
    """``t`` with rows of ``fill`` appended up to ``num_rows``, contiguous."""
    missing = num_rows - t_TX.shape[0]
    if missing <= 0:
        return t_TX.contiguous()
    return torch.cat([t_TX, t_TX.new_full((missing, *t_TX.shape[1:]), fill)]).contiguous()


def _rows_per_rank(topk_ids_TK: torch.Tensor, num_local: int, ep_size: int) -> torch.Tensor:
    """``[P]``: the rows this rank sends each rank."""
    ids_S = topk_ids_TK.reshape(-1).long()
    dest_S = torch.where(ids_S < 0, ep_size, ids_S // num_local)
    count_X = torch.zeros(ep_size + 1, dtype=torch.int64, device=ids_S.device)
    return count_X.scatter_add_(0, dest_S, torch.ones_like(dest_S))[:ep_size]


# Normal mode: src_R is each row's received slot n * K + k, n < N.

def _sum_received(rows_RH: torch.Tensor, src_R: torch.Tensor, num_received: int,
                  top_k: int) -> torch.Tensor:
    """``[N, H]`` bf16: each received token's rows summed in slot order (fp32)."""
    rows = torch.arange(src_R.shape[0], device=src_R.device)
    row_of_slot_S = scatter_index(rows, src_R, num_received * top_k)
    return sum_slots(rows_RH.to(DTYPE), row_of_slot_S.view(num_received, top_k))


def _normal_dispatch(comm, hidden_TH, topk_weights_TK, topk_ids_TK, num_rows, spec=None):
    """``Buffer.dispatch`` into rows: dispatch's six outputs, then with ``spec`` (rows
    quantized before they leave, `fp8_transport_reason` None) ``x_scale``."""
    num_tokens, top_k = topk_ids_TK.shape
    padded = max(num_tokens, 1)
    x = _pad_tokens(hidden_TH, padded, 0)
    if spec is not None:
        q_TH, scale = quant.quantize_activations(x, spec)
        x = (q_TH, scale.reshape(padded, -1))
    ids_TK = _pad_tokens(topk_ids_TK.to(comm.topk_idx_dtype), padded, -1)
    weights_TK = _pad_tokens(topk_weights_TK.float(), padded, 0)
    buffer = comm.buffer
    per_rank, per_rdma_rank, per_expert, in_rank, _ = buffer.get_dispatch_layout(
        ids_TK, comm.num_experts)
    recv_x, recv_ids_NK, recv_weights_NK, _, handle, _ = buffer.dispatch(
        x, topk_idx=ids_TK, topk_weights=weights_TK, num_tokens_per_rank=per_rank,
        num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert,
        num_worst_tokens=comm.ep_size * comm.max_tokens_per_rank, config=comm.dispatch_config)
    # DeepEP gives local expert ids, -1 for another rank's expert and for padding tokens.
    order_S, sorted_ids_S, count_E = sort_rows(recv_ids_NK, comm.num_local_experts)
    order_R, expert_R = order_S[:num_rows], sorted_ids_S[:num_rows]
    src_R = order_R.masked_fill(expert_R < 0, -1).to(torch.int32)
    x_RH, *scale = _received_rows(recv_x, block_of(src_R, top_k), spec)
    weight_R = gather_rows(recv_weights_NK.reshape(-1, 1).float(), src_R)[:, 0]
    comm.remember(src_R, handle)
    slot_map_TK = torch.full((num_tokens, top_k), -1, dtype=torch.int32,
                             device=topk_ids_TK.device)
    return (x_RH, expert_R.to(torch.int32), weight_R, src_R, count_E.clone(), slot_map_TK,
            *scale)


def _received_rows(recv_x, index_R: torch.Tensor, spec: QuantSpec | None) -> tuple:
    """Rows ``index_R`` (-1: zeros) of what a DeepEP dispatch delivered (``[..., H]``
    bf16; with ``spec``, DeepEP's fp8 pair ``(values [..., H], scales [..., A])``):
    ``(x_RH,)``, or ``(x_RH fp8, x_scale)`` as ``moe::dispatch_quant`` returns them."""
    if spec is None:
        return (gather_rows(_flat(recv_x), index_R),)
    recv_x, recv_scale = recv_x
    # As bytes: float8 has no gather or fill on the CPU.
    x_RH = gather_rows(_flat(recv_x).view(torch.uint8), index_R).view(quant.FP8_DTYPE)
    scale_RA = gather_rows(_flat(recv_scale), index_R)
    return x_RH, scale_RA[:, 0] if spec.activations == "fp8_token" else scale_RA


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``[..., X]`` as ``[rows, X]`` (a copy where the layout asks for one)."""
    return t.reshape(-1, t.shape[-1])


def _normal_combine(comm, handle, rows_RH, src_R, num_tokens, top_k, grad_weight_R=None):
    """``Buffer.combine`` of the rows (and of per-slot ``grad_weight_R``): ``[T, H]``
    (and ``[T, K]``)."""
    num_received = comm.ep_size * comm.max_tokens_per_rank
    summed_NH = _sum_received(rows_RH, src_R, num_received, top_k)
    weights_NK = None
    if grad_weight_R is not None:
        weights_NK = scatter_rows(grad_weight_R.float().unsqueeze(1), src_R,
                                  num_received * top_k).view(num_received, top_k).contiguous()
    combined_TH, combined_weights_TK, _ = comm.buffer.combine(
        summed_NH, handle, topk_weights=weights_NK, config=comm.combine_config)
    if grad_weight_R is None:
        return combined_TH[:num_tokens]
    return combined_TH[:num_tokens], combined_weights_TK[:num_tokens]


def _normal_send_out(comm, handle, grad_out_TH, src_R, top_k):
    """Cached-handle ``Buffer.dispatch`` of ``grad_out``: each row's token's gradient."""
    padded = _pad_tokens(grad_out_TH.to(DTYPE), max(grad_out_TH.shape[0], 1), 0)
    recv_NH, *_ = comm.buffer.dispatch(padded, handle=handle, config=comm.dispatch_config)
    return gather_rows(recv_NH, block_of(src_R, top_k))


# Low-latency mode: src_R is e * Q + key, key = p * M + t.

def _ll_keys(src_info_EQ: torch.Tensor, layout_range_EP: torch.Tensor,
             max_tokens: int) -> torch.Tensor:
    """``[L]`` int64: the key of the token at each position of a low-latency dispatch, -1
    where none is. Rank ``p``'s tokens for expert ``e`` sit at ``[begin, begin + count)``
    (``layout_range``: count in the low, begin in the high 32 bits; the blocks of one
    expert tile ``[0, sum count)`` in arrival order), ``src_info`` is each token's index
    on its rank."""
    num_local, num_positions = src_info_EQ.shape
    ep_size = layout_range_EP.shape[1]
    device = src_info_EQ.device
    count_EP = layout_range_EP & 0xFFFFFFFF
    begin_EP = layout_range_EP >> 32
    # p + 1 where rank p's block starts (empty blocks go to an extra column), then each
    # position takes the rank of the last block that started at or before it.
    start_EX = torch.zeros((num_local, num_positions + 1), dtype=torch.int64, device=device)
    ranks_EP = torch.arange(1, ep_size + 1, device=device).expand(num_local, ep_size)
    start_EX.scatter_(1, torch.where(count_EP > 0, begin_EP, num_positions), ranks_EP)
    position_Q = torch.arange(num_positions, device=device)
    last_start_EQ = torch.where(start_EX[:, :num_positions] > 0, position_Q, 0).cummax(1).values
    rank_EQ = torch.gather(start_EX, 1, last_start_EQ) - 1
    valid_EQ = position_Q < count_EP.sum(1, keepdim=True)
    key_EQ = torch.where(valid_EQ, rank_EQ * max_tokens + src_info_EQ.long(), -1)
    return key_EQ.reshape(-1)


def _ll_position_of_cell(key_L: torch.Tensor, num_positions: int) -> torch.Tensor:
    """``[L]``: for each cell ``e * Q + key``, the position of that token in expert
    ``e``'s block of the dispatch, -1 where it did not come."""
    cells = torch.arange(key_L.shape[0], device=key_L.device)
    expert_L = cells // num_positions
    cell_L = torch.where(key_L < 0, -1, expert_L * num_positions + key_L)
    return scatter_index(cells % num_positions, cell_L, key_L.shape[0])


def _ll_dispatch(comm, hidden_TH, topk_weights_TK, topk_ids_TK, num_rows, spec=None):
    """``Buffer.low_latency_dispatch`` into rows: dispatch's six outputs, then with
    ``spec`` (DeepEP's fp8 cast, `fp8_transport_reason` None) ``x_scale``."""
    num_tokens, top_k = topk_ids_TK.shape
    ep_size, max_tokens, num_local = comm.ep_size, comm.max_tokens_per_rank, comm.num_local_experts
    num_positions = ep_size * max_tokens
    padded = max(num_tokens, 1)
    x_TH = _pad_tokens(hidden_TH, padded, 0)
    ids_TK = _pad_tokens(topk_ids_TK.to(comm.topk_idx_dtype), padded, -1)
    recv_x, _, handle, _, _ = comm.buffer.low_latency_dispatch(
        x_TH, ids_TK, max_tokens, comm.num_experts, use_fp8=spec is not None,
        async_finish=False, return_recv_hook=False)
    key_L = _ll_keys(handle[0], handle[1], max_tokens)
    position_L = _ll_position_of_cell(key_L, num_positions)
    # Rows in cell order (expert, then key): rows of expert e from its first row on.
    present_EQ = (position_L >= 0).view(num_local, num_positions)
    count_E = present_EQ.sum(1, dtype=torch.int32)
    offset_E = torch.cumsum(count_E, 0) - count_E
    row_L = (offset_E.unsqueeze(1) + torch.cumsum(present_EQ, 1) - 1).masked_fill(
        ~present_EQ, -1).reshape(-1)
    # Rows past the capacity cannot come: dispatch checked it when C is below the worst case.
    row_L = torch.where(row_L < num_rows, row_L, -1)
    cells = torch.arange(key_L.shape[0], device=key_L.device)
    src_R = scatter_index(cells, row_L, num_rows)
    expert_R = block_of(src_R, num_positions)
    position_R = gather_index(position_L, src_R)
    x_RH, *scale = _received_rows(
        recv_x, torch.where(src_R < 0, -1, expert_R * num_positions + position_R), spec)
    # DeepEP does not move the routing weights: read each row's in every rank's routing.
    ids_MK = _pad_tokens(topk_ids_TK.to(torch.int32), max_tokens, -1)
    weights_MK = _pad_tokens(topk_weights_TK.float(), max_tokens, 0).view(torch.int32)
    routing_GX = collectives.all_gather(torch.cat([ids_MK, weights_MK], 1), comm.group_name,
                                        ep_size)
    row_routing_RX = gather_rows(routing_GX, torch.where(src_R < 0, -1, src_R % num_positions))
    row_ids_RK = row_routing_RX[:, :top_k]
    row_weights_RK = row_routing_RX[:, top_k:].contiguous().view(torch.float32)
    chosen_RK = row_ids_RK == (comm.rank * num_local + expert_R).unsqueeze(1)
    weight_R = (row_weights_RK * chosen_RK).sum(1).masked_fill(src_R < 0, 0.0)
    slot_map_TK = topk_ids_TK.to(torch.int32, memory_format=torch.contiguous_format, copy=True)
    return (x_RH, expert_R.to(torch.int32), weight_R, src_R.to(torch.int32), count_E,
            slot_map_TK, *scale)


def _ll_handle(comm, src_R: torch.Tensor):
    """DeepEP's low-latency handle for rows in ``src_R``'s order, and each row's
    position in the ``[E_l, Q]`` block ``low_latency_combine`` reads."""
    ep_size, max_tokens, num_local = comm.ep_size, comm.max_tokens_per_rank, comm.num_local_experts
    num_positions = ep_size * max_tokens
    valid_R = src_R >= 0
    cell_R = src_R.long()
    expert_R = torch.where(valid_R, cell_R // num_positions, num_local)
    key_R = cell_R % num_positions
    rank_R, token_R = key_R // max_tokens, key_R % max_tokens
    ones_R = torch.ones_like(expert_R)
    count_X = torch.zeros(num_local + 1, dtype=torch.int64, device=src_R.device)
    count_E = count_X.scatter_add_(0, expert_R, ones_R)[:num_local]
    offset_E = torch.cumsum(count_E, 0) - count_E
    rows_R = torch.arange(src_R.shape[0], device=src_R.device)
    position_R = rows_R - offset_E[expert_R.clamp(max=num_local - 1)]
    slot_R = torch.where(valid_R, expert_R * num_positions + position_R, -1)
    # Rows of one expert are ordered by key: each rank's block is contiguous.
    pair_R = torch.where(valid_R, expert_R * ep_size + rank_R, num_local * ep_size)
    count_X = torch.zeros(num_local * ep_size + 1, dtype=torch.int64, device=src_R.device)
    count_EP = count_X.scatter_add_(0, pair_R, ones_R)[:-1].view(num_local, ep_size)
    begin_EP = torch.cumsum(count_EP, 1) - count_EP
    layout_range_EP = (begin_EP << 32) | count_EP
    num_cells = num_local * num_positions
    src_info_EQ = scatter_index(token_R, slot_R, num_cells).to(
        torch.int32).view(num_local, num_positions)
    handle = (src_info_EQ, layout_range_EP.contiguous(), max_tokens, comm.hidden_size,
              comm.num_experts)
    return handle, slot_R


def _ll_combine(comm, rows_RH, src_R, slot_map_TK):
    """``low_latency_combine`` of the rows: ``[T, H]``, each token's rows summed."""
    num_tokens, top_k = slot_map_TK.shape
    handle, slot_R = _ll_handle(comm, src_R)
    num_cells = comm.num_local_experts * comm.ep_size * comm.max_tokens_per_rank
    x_EQH = scatter_rows(rows_RH.to(DTYPE), slot_R, num_cells).view(
        comm.num_local_experts, -1, comm.hidden_size)
    padded = max(num_tokens, 1)
    ids_TK = _pad_tokens(slot_map_TK.to(comm.topk_idx_dtype), padded, -1)
    ones_TK = torch.ones((padded, top_k), dtype=torch.float32, device=rows_RH.device)
    combined_TH, _, _ = comm.buffer.low_latency_combine(
        x_EQH, ids_TK, ones_TK, handle, async_finish=False, return_recv_hook=False)
    return combined_TH[:num_tokens]


def _ll_send_out(comm, grad_out_TH, src_R, slot_map_TK):
    """A second ``low_latency_dispatch``, of ``grad_out``: each row's token's gradient."""
    num_tokens = slot_map_TK.shape[0]
    num_positions = comm.ep_size * comm.max_tokens_per_rank
    padded = max(num_tokens, 1)
    grad_TH = _pad_tokens(grad_out_TH.to(DTYPE), padded, 0)
    ids_TK = _pad_tokens(slot_map_TK.to(comm.topk_idx_dtype), padded, -1)
    recv_EQH, _, handle, _, _ = comm.buffer.low_latency_dispatch(
        grad_TH, ids_TK, comm.max_tokens_per_rank, comm.num_experts, use_fp8=False,
        async_finish=False, return_recv_hook=False)
    position_L = _ll_position_of_cell(_ll_keys(handle[0], handle[1], comm.max_tokens_per_rank),
                                      num_positions)
    position_R = gather_index(position_L, src_R)
    expert_R = block_of(src_R.long(), num_positions)
    return gather_rows(recv_EQH.view(-1, comm.hidden_size),
                       torch.where(position_R < 0, -1, expert_R * num_positions + position_R))


def _ll_weight_grads(comm, grad_weight_R, src_R, slot_map_TK):
    """``[T, K]``: each row's routing-weight gradient back to its (token, slot)."""
    num_tokens, _ = slot_map_TK.shape
    ep_size, max_tokens, num_local = comm.ep_size, comm.max_tokens_per_rank, comm.num_local_experts
    num_positions = ep_size * max_tokens
    cell_R = src_R.long()
    key_R, expert_R = cell_R % num_positions, cell_R // num_positions
    target_R = torch.where(src_R < 0, -1, key_R * num_local + expert_R)
    per_key_GE = scatter_rows(grad_weight_R.float().unsqueeze(1), target_R,
                              num_positions * num_local).view(num_positions, num_local)
    # Block p (rank p's tokens) goes home; block q received holds rank q's experts.
    mine_PME = collectives.all_to_all(per_key_GE, comm.group_name, ep_size)
    mine_ME = mine_PME.view(ep_size, max_tokens, num_local).transpose(0, 1).reshape(
        max_tokens, ep_size * num_local)
    ids_TK = slot_map_TK.long()
    grad_TK = torch.gather(mine_ME[:num_tokens], 1, ids_TK.clamp(min=0))
    return grad_TK.masked_fill(ids_TK < 0, 0.0)


# The ops.

def _transport(src_R, group_name, ep_size, max_tokens_per_rank, hidden_size, top_k, dtype):
    """The communicator that ran the dispatch of ``src_R``, and its normal-mode handle
    (None in low-latency mode)."""
    collectives.rank_in(group_name, ep_size)
    for comm in _COMMUNICATORS.values():
        if comm.mode == NORMAL and comm.group_name == group_name:
            handle = comm.recall(src_R)
            if handle is not None:
                return comm, handle
    for comm in _COMMUNICATORS.values():
        if comm.mode == LOW_LATENCY and comm.matches(group_name, hidden_size, top_k,
                                                      max_tokens_per_rank, dtype):
            return comm, None
    raise RuntimeError("src_rows must be the tensor that a2a backend 'deepep''s dispatch returned "
                       f"on this rank (group {group_name!r}): its normal-mode DeepEP handle lives "
                       "as long as that tensor's storage, and no low-latency communicator matches "
                       f"(H={hidden_size}, K={top_k}, max_tokens_per_rank={max_tokens_per_rank})")


def _dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
              max_tokens_per_rank, capacity, spec=None):
    """Dispatch's six outputs, and with ``spec`` the rows in fp8 and ``x_scale``."""
    _check_tensor("hidden", hidden_TH)
    num_tokens, top_k = topk_ids_TK.shape
    num_local = num_experts // ep_size
    collectives.rank_in(group_name, ep_size)
    with _on(hidden_TH.device):
        comm = communicator(group_name, hidden_TH.shape[1], num_experts, top_k,
                            max_tokens_per_rank, hidden_TH.dtype, device=hidden_TH.device)
        comm.check_tokens(num_tokens)
        if capacity < worst_case_capacity(max_tokens_per_rank, top_k):
            collectives.check_capacity(_rows_per_rank(topk_ids_TK, num_local, ep_size), capacity,
                                       group_name,
                                       "a rank sends another more rows than the capacity")
        run = _ll_dispatch if comm.mode == LOW_LATENCY else _normal_dispatch
        args = (comm, hidden_TH, topk_weights_TK, topk_ids_TK, ep_size * capacity)
        if spec is None or fp8_transport_reason(comm.mode, spec, hidden_TH.shape[1]) is None:
            return run(*args, spec)
        # A row is a copy of its token: quantized here, it gets the values quantizing
        # the token before it left would have given.
        x_RH, *routing = run(*args)
        q_RH, x_scale = quant.quantize_activations(x_RH, spec)
        return (q_RH, *routing, x_scale)


def dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
             max_tokens_per_rank, capacity):
    return _dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                     max_tokens_per_rank, capacity)


def dispatch_quant(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, weight_format,
                   activation_format, block_size, ep_size, group_name, max_tokens_per_rank,
                   capacity):
    spec = QuantSpec.from_op_args(weight_format, activation_format, block_size)
    return _dispatch(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, ep_size, group_name,
                     max_tokens_per_rank, capacity, spec)


def combine(y_RH, weight_R, src_R, slot_map_TK, ep_size, group_name, max_tokens_per_rank):
    _check_tensor("y_rows", y_RH)
    num_tokens, top_k = slot_map_TK.shape
    with _on(y_RH.device):
        comm, handle = _transport(src_R, group_name, ep_size, max_tokens_per_rank,
                                  y_RH.shape[1], top_k, y_RH.dtype)
        rows_RH = weighted_rows(y_RH, weight_R, src_R)
        if handle is None:
            return _ll_combine(comm, rows_RH, src_R, slot_map_TK)
        return _normal_combine(comm, handle, rows_RH, src_R, num_tokens, top_k)


def dispatch_backward(grad_x_RH, grad_weight_R, src_R, slot_map_TK, ep_size, group_name,
                      max_tokens_per_rank):
    _check_tensor("grad_x_rows", grad_x_RH)
    num_tokens, top_k = slot_map_TK.shape
    with _on(grad_x_RH.device):
        comm, handle = _transport(src_R, group_name, ep_size, max_tokens_per_rank,
                                  grad_x_RH.shape[1], top_k, grad_x_RH.dtype)
        if handle is None:
            return (_ll_combine(comm, grad_x_RH, src_R, slot_map_TK),
                    _ll_weight_grads(comm, grad_weight_R, src_R, slot_map_TK))
        grad_hidden_TH, grad_weights_TK = _normal_combine(comm, handle, grad_x_RH, src_R,
                                                          num_tokens, top_k, grad_weight_R)
        return grad_hidden_TH, grad_weights_TK.float()


def combine_backward(grad_out_TH, y_RH, weight_R, src_R, slot_map_TK, ep_size, group_name,
                     max_tokens_per_rank):
    _check_tensor("y_rows", y_RH)
    top_k = slot_map_TK.shape[1]
    with _on(y_RH.device):
        comm, handle = _transport(src_R, group_name, ep_size, max_tokens_per_rank,
                                  y_RH.shape[1], top_k, y_RH.dtype)
        if handle is None:
            grad_RH = _ll_send_out(comm, grad_out_TH, src_R, slot_map_TK)
        else:
            grad_RH = _normal_send_out(comm, handle, grad_out_TH, src_R, top_k)
        return combine_grads(grad_RH, y_RH, weight_R, src_R)


def supports(spec, problem, device) -> str | None:
    if not dist.is_available():
        return "this torch has no torch.distributed"
    deep_ep, reason = _import_deep_ep()
    if reason is not None:
        return reason
    if device.type != "cuda":
        return f"needs CUDA GPUs (DeepEP's NVLink/RDMA kernels), got device {device}"
    if not torch.cuda.is_available():
        return "needs CUDA GPUs (DeepEP's NVLink/RDMA kernels): this torch sees none"
    if problem.ep_size is not None and problem.ep_size < 2:
        return "needs expert parallelism (ep_size > 1); a2a 'none' runs one device"
    if problem.dtype != DTYPE:
        return (f"DeepEP moves bfloat16 activations (bf16, or fp8 quantized from bf16), got "
                f"{problem.dtype}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    if deep_ep.Buffer.is_sm90_compiled() and torch.cuda.get_device_capability(index) < (9, 0):
        return (f"this DeepEP build targets sm90 and GPU {index} is "
                f"sm{''.join(map(str, torch.cuda.get_device_capability(index)))}")
    num_local = problem.num_local_experts
    if num_local is None and problem.num_experts is not None and problem.ep_size:
        num_local = problem.num_experts // problem.ep_size
    shape = (problem.ep_size, problem.hidden_size, problem.top_k)
    if problem.max_tokens_per_rank is None:
        normal = normal_mode_reason(*shape, num_local)
        low_latency = low_latency_mode_reason(*shape, None)
        if normal is not None and low_latency is not None:
            return f"{normal}; {low_latency}"
        return None
    mode = choose_mode(*shape, problem.max_tokens_per_rank)
    return _mode_reason(mode, *shape, num_local, problem.max_tokens_per_rank)


define_backend_ops(NAMESPACE, {"dispatch": dispatch, "combine": combine,
                               "dispatch_backward": dispatch_backward,
                               "combine_backward": combine_backward,
                               "dispatch_quant": dispatch_quant})

REGISTRY.register_a2a(A2ABackend(
    name="deepep", namespace=NAMESPACE, supports=supports,
    description=(f"DeepEP: normal mode (worst-case static receive, NVLink/RDMA) or, for "
                 f"max_tokens_per_rank <= {LOW_LATENCY_MAX_TOKENS}, low-latency mode")))
