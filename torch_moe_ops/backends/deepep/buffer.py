"""DeepEP's state for one layer shape on one process group: the `DeepEPCommunicator`
(its ``deep_ep.Buffer``, configs and the handles its dispatches leave) and the one keyed
cache that holds the open ones.

A ``Buffer`` is sized from DeepEP's hints (normal mode: ``Config.get_nvl_buffer_size_hint``
and ``get_rdma_buffer_size_hint`` of the dispatch and combine configs; low-latency:
``Buffer.get_low_latency_rdma_size_hint(M, H, P, E)``), created once, outside CUDA graph
capture (the first eager call creates it, collectively), and released by ``close()`` /
`close_all()` (collective: call them on every rank). Low-latency mode and groups over
several hosts initialise NVSHMEM, which a process holds once: one such communicator at a
time. Creating a ``Buffer`` sets DeepEP's ``NVSHMEM_*`` environment variables (DeepEP does
that, this package does not). A communicator sized for bf16 rows holds an fp8 row and its
scales: one serves both.

Legend: T tokens on this rank, H hidden size, E experts, K experts per token, M =
max_tokens_per_rank, P ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import socket
import weakref

import torch
import torch.distributed as dist

from torch_moe_ops.backends.common.transport import collectives
from torch_moe_ops.backends.common.transport.communicators import Communicators
from torch_moe_ops.backends.deepep import configs
from torch_moe_ops.backends.deepep.modes import (
    DTYPE,
    LOW_LATENCY,
    LOW_LATENCY_MAX_TOKENS,
    MODES,
    NORMAL,
    choose_mode,
    mode_reason,
)

NOT_INSTALLED = ("DeepEP is not installed: build it from source (python -m "
                 "torch_moe_ops.backends.install deepep says how); PyPI's deep_ep has no kernels")
# Where the activations must be (the CPU stand-in of tests/deepep_emulator.py sets "cpu").
DEVICE_TYPE = "cuda"


def import_deep_ep():
    """``(deep_ep, None)``, or ``(None, the reason it cannot be used)``."""
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
    deep_ep, reason = import_deep_ep()
    if reason is not None:
        raise RuntimeError(f"a2a backend 'deepep': {reason}")
    return deep_ep


def on(device: torch.device):
    """``device`` current (DeepEP allocates and launches on the current CUDA device)."""
    device = torch.device(device)
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class _Dispatched:
    """What one normal-mode rows dispatch leaves for its combine and gradients."""

    handle: tuple
    storage: weakref.ref


@dataclasses.dataclass(frozen=True)
class TokensDispatch:
    """What the last ``dispatch_tokens`` leaves for its ``combine_tokens``: DeepEP's
    handle and the tokens it sent (T)."""

    handle: tuple
    num_tokens: int


def _forget(handles: dict, address: int, entry: _Dispatched) -> None:
    if handles.get(address) is entry:
        del handles[address]


def _check_one_host(group: dist.ProcessGroup, group_name: str) -> None:
    """Raise on every rank where the group's ranks are not all on this host: normal mode
    runs intranode only (`modes.normal_mode_reason`), its buffers shared over NVLink."""
    hosts: list[str | None] = [None] * group.size()
    dist.all_gather_object(hosts, socket.gethostname(), group=group)
    if len(set(hosts)) > 1:
        raise ValueError(f"a2a backend 'deepep' runs normal mode on the ranks of one host "
                         f"(DeepEP's static receive size, num_worst_tokens, is intranode-only), "
                         f"but group {group_name!r} spans hosts {sorted(set(hosts))}: use "
                         f"low-latency mode (max_tokens_per_rank <= {LOW_LATENCY_MAX_TOKENS}) "
                         "or a2a='all_to_all'")


class DeepEPCommunicator:
    """DeepEP's state for one layer shape and mode on one process group: the
    ``deep_ep.Buffer`` (sized for ``mode`` from DeepEP's hints, allocated once), its
    configs, the normal-mode handles of the rows dispatches whose ``src_rows`` are still
    alive, that of the last tokens dispatch (``tokens_dispatch``) and those of the chunks in
    flight (``in_flight``, `in_flight`).

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
        self.tokens_dispatch: TokensDispatch | None = None
        # The handles of the chunks dispatched in flight and not yet combined (`in_flight`).
        self.in_flight: dict[int, tuple] = {}
        buffer_cls = deep_ep.Buffer
        normal = mode == NORMAL
        # Normal mode's kernels take `configs.NUM_SMS` SMs as it stands at opening: the
        # buffer is sized for that many channels.
        self.num_sms = configs.NUM_SMS if normal else None
        device_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                      if device.type == "cuda" else None)
        self.dispatch_config, self.combine_config = (
            configs.normal_configs(deep_ep, self.ep_size, device_sms) if normal
            else (None, None))
        with on(device):
            if mode == LOW_LATENCY:
                num_nvl_bytes = 0
                num_rdma_bytes = buffer_cls.get_low_latency_rdma_size_hint(
                    max_tokens_per_rank, hidden_size, self.ep_size, num_experts)
                # DeepEP: one queue pair per local expert.
                num_qps = self.num_local_experts
            else:
                _check_one_host(group, group_name)
                hidden_bytes = hidden_size * max(dtype.itemsize, 2)
                num_nvl_bytes = max(c.get_nvl_buffer_size_hint(hidden_bytes, self.ep_size)
                                    for c in (self.dispatch_config, self.combine_config))
                # Intranode (`modes.normal_mode_reason`): NVLink buffers only.
                num_rdma_bytes, num_qps = 0, 1
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
                f"max_tokens_per_rank={self.max_tokens_per_rank}"
                f"{'' if self.num_sms is None else f', {self.num_sms} SMs'}, {state})")

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
        self.tokens_dispatch = None
        self.in_flight.clear()
        with on(self.device):
            self.buffer.destroy()
        self.buffer = None
        key = _key(self.group_name, self.hidden_size, self.num_experts, self.top_k,
                   self.max_tokens_per_rank, self.dtype, self.mode)
        _COMMUNICATORS.forget(key, self)


# The one cache of this package: open communicators by (group, H, E, K, M, dtype, mode).
# `communicator` fills it, `DeepEPCommunicator.close` and `close_all` empty it.
_COMMUNICATORS = Communicators()


def _key(group_name, hidden_size, num_experts, top_k, max_tokens_per_rank, dtype,
         mode) -> tuple:
    return (group_name, hidden_size, num_experts, top_k, max_tokens_per_rank, str(dtype), mode)


def communicator(group_name: str, hidden_size: int, num_experts: int, top_k: int,
                 max_tokens_per_rank: int, dtype: torch.dtype = DTYPE, mode: str = "auto",
                 device: torch.device | str | None = None) -> DeepEPCommunicator:
    """The communicator of this layer shape on group ``group_name``, created on first use.

    Creating one is collective (DeepEP exchanges buffer handles over the group) and
    cannot happen inside CUDA graph capture: every rank calls this, or runs the
    layer once eagerly, before capturing. ``mode`` ("normal", "low_latency") is the mode
    the layer's ops run (its plan fixes it: `supports.mode_of`); "auto" is the one its rows
    run (`choose_mode`). A shape may have one communicator of each mode open; which one an
    op uses follows from the op (`modes.ROWS_NAMESPACES`), never from what is open.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(map(repr, MODES))}, got {mode!r}")
    shape = (group_name, hidden_size, num_experts, top_k, max_tokens_per_rank, dtype)
    ep_size = collectives.group_of(group_name).size()
    if mode == "auto":
        mode = choose_mode(ep_size, hidden_size, top_k, max_tokens_per_rank)
    existing = _COMMUNICATORS.get(_key(*shape, mode))
    if existing is not None:
        return existing
    if dtype != DTYPE:
        raise ValueError(f"dtype must be {DTYPE} (DeepEP moves bf16 activations), got {dtype}")
    if num_experts % ep_size:
        raise ValueError(f"num_experts must be divisible by the group size ({ep_size}), got "
                         f"{num_experts}")
    reason = mode_reason(mode, ep_size, hidden_size, top_k, num_experts // ep_size,
                         max_tokens_per_rank)
    if reason is not None:
        raise ValueError(f"a2a backend 'deepep' cannot run mode {mode!r} here: {reason}")
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"the DeepEP communicator of group {group_name!r} (H={hidden_size}, "
                           f"E={num_experts}, K={top_k}, max_tokens_per_rank="
                           f"{max_tokens_per_rank}, mode {mode!r}) must be created before "
                           "CUDA graph capture: run the layer once eagerly, or call "
                           "torch_moe_ops.backends.deepep.communicator(...) on every rank first")
    # Only low-latency mode initialises NVSHMEM: normal mode runs intranode, over NVLink.
    if mode == LOW_LATENCY:
        holder = next((c for c in _COMMUNICATORS.values() if c.uses_nvshmem), None)
        if holder is not None:
            raise RuntimeError(f"DeepEP's {mode} mode on {ep_size} ranks initialises NVSHMEM, "
                               f"which this process already holds for {holder!r}: one such "
                               "communicator per process; close it (on every rank) first")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device())
    created = DeepEPCommunicator(group_name, hidden_size, num_experts, top_k,
                                 max_tokens_per_rank, dtype, mode, torch.device(device))
    _COMMUNICATORS[_key(*shape, mode)] = created
    return created


def opened(group_name: str, hidden_size: int, num_experts: int, top_k: int,
           max_tokens_per_rank: int, dtype: torch.dtype, mode: str) -> DeepEPCommunicator:
    """The open communicator of this shape and mode: a combine follows its dispatch."""
    return _COMMUNICATORS.opened(
        _key(group_name, hidden_size, num_experts, top_k, max_tokens_per_rank, dtype, mode),
        "deepep", f"mode {mode} on group {group_name!r}, H={hidden_size}, E={num_experts}, "
        f"K={top_k}, max_tokens_per_rank={max_tokens_per_rank}, {dtype}")


close_all = _COMMUNICATORS.close_all
open_communicators = _COMMUNICATORS.in_key_order
communicators = _COMMUNICATORS.values


def check_tensor(name: str, t: torch.Tensor) -> None:
    """Activations DeepEP moves: bf16, on a CUDA device."""
    if t.device.type != DEVICE_TYPE:
        raise ValueError(f"{name} must be on a CUDA device for a2a backend 'deepep', got "
                         f"{t.device}")
    if t.dtype != DTYPE:
        raise ValueError(f"{name} must be {DTYPE} for a2a backend 'deepep' (DeepEP moves bf16 "
                         f"activations), got {t.dtype}: run the layer in bfloat16 or choose "
                         "another a2a backend")


@contextlib.contextmanager
def dispatching(name: str, x: torch.Tensor, top_k: int, num_experts: int, ep_size: int,
                group_name: str, max_tokens_per_rank: int, mode: str):
    """The communicator of ``x``'s layer shape in ``mode``, opened on first use
    (`communicator`; ``x`` checked as the activations argument ``name``, this rank checked
    in ``group_name``), with ``x``'s device current: where a dispatch runs."""
    check_tensor(name, x)
    collectives.rank_in(group_name, ep_size)
    with on(x.device):
        yield communicator(group_name, x.shape[-1], num_experts, top_k, max_tokens_per_rank,
                           x.dtype, mode=mode, device=x.device)


@contextlib.contextmanager
def answering(name: str, y: torch.Tensor, top_k: int, num_experts: int, ep_size: int,
              group_name: str, max_tokens_per_rank: int, mode: str):
    """The open communicator of ``y``'s layer shape in ``mode`` (`opened`; ``y`` checked as
    the activations argument ``name``, this rank checked in ``group_name``), with ``y``'s
    device current: where a combine answers its dispatch."""
    check_tensor(name, y)
    collectives.rank_in(group_name, ep_size)
    with on(y.device):
        yield opened(group_name, y.shape[-1], num_experts, top_k, max_tokens_per_rank, y.dtype,
                     mode)


def pad_tokens(t_TX: torch.Tensor, num_rows: int, fill) -> torch.Tensor:
    """``t`` with rows of ``fill`` appended up to ``num_rows``, contiguous."""
    missing = num_rows - t_TX.shape[0]
    if missing <= 0:
        return t_TX.contiguous()
    return torch.cat([t_TX, t_TX.new_full((missing, *t_TX.shape[1:]), fill)]).contiguous()
