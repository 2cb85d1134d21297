"""Prepared copies of a layer's weights, kept by their source tensors: by (tensor,
version), as docs/architecture.md ("State") asks of a backend whose kernels read another
layout. Each such backend keeps one `WeightCache` in its own module (the ``flashinfer``
experts' converted weights, the ``triton`` experts' MXFP4 fragments), and makes what
outlives a call inside `outside_graph_pools`, where the GPU has the memory to spare for it
(`spare_bytes`)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import weakref
from collections.abc import Callable
from typing import TypeVar

import torch

from torch_moe_ops import torch_compat

T = TypeVar("T")

# What a layer's copy must leave free of the GPU's memory (activations, the KV cache and the
# allocator's slack of whatever runs the model): 5 GB of an 80 GB GPU.
RESERVE_FRACTION = 1 / 16


def spare_bytes(device: torch.device) -> int | None:
    """Bytes a copy may take on ``device`` and leave `RESERVE_FRACTION` of its memory free
    (what the driver has free and the caching allocator holds unused); None: no limit
    (not a GPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + unused - int(total * RESERVE_FRACTION)


@dataclasses.dataclass(frozen=True)
class _Entry:
    versions: tuple
    storages: tuple
    prepared: object
    # One per source storage; each holds the entry weakly (``prepared`` may hold a
    # source itself: a strong hold would keep that source alive for good).
    finalizers: list = dataclasses.field(default_factory=list)

    def detach(self) -> None:
        for finalizer in self.finalizers:
            finalizer.detach()


def _where(t: torch.Tensor | None) -> tuple | None:
    if t is None:
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
            tuple(t.stride()), t.dtype, t.device)


def _version(t: torch.Tensor | None) -> int | None:
    return None if t is None else torch_compat.tensor_version(t)


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}
# One thread of its own: CUDA graphs' pools take the allocations of a thread, not a stream.
_WORKER = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="torch_moe_ops_weights")
# Set on that thread: a call made from it runs in place (waiting for itself would hang).
_ON_WORKER = threading.local()


def outside_graph_pools(device: torch.device, make: Callable[[], T]) -> T:
    """``make()``, run where what it allocates on ``device`` comes from the caching
    allocator's own pools, for tensors that outlive the call (prepared weights, the
    autotuner's buffers).

    A compiled layer's first call runs inside a CUDA graph's memory pool (Inductor's
    CUDA-graph trees warm up there), and a tensor made then and kept raises "tensor(s)
    in the cudagraph pool not tracked as outputs". That pool takes every allocation of
    the thread that warms up, whatever the stream, so ``make`` runs on a thread of its own
    (with the caller's grad mode), on a side stream ordered after the caller's current
    stream's work and before what follows. Each call waits for the current stream, so a
    block freed later and handed out here again is not written before the kernels that
    read it have run. Raises during a capture: kernels do not run then, and a copy made
    would hold garbage.
    """
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("a layer's weights are converted to its kernels' layout on its "
                           "first call, which cannot be captured in a CUDA graph: run the "
                           "layer once before capturing (or after changing its weights)")
    if device.type != "cuda" or getattr(_ON_WORKER, "active", False):
        return make()
    current = torch.cuda.current_stream(device)
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    side = _SIDE_STREAMS[device]
    grad_enabled = torch.is_grad_enabled()

    def run() -> T:
        _ON_WORKER.active = True
        with torch.cuda.device(device), torch.set_grad_enabled(grad_enabled):
            side.wait_stream(current)
            with torch.cuda.stream(side):
                return make()

    made = _WORKER.submit(run).result()
    current.wait_stream(side)
    return made


class WeightCache:
    """Prepared weights by their source tensors: by (tensor, version), as
    docs/architecture.md ("State") asks.

    An entry serves a call whose sources have the storage, offset, shape, strides,
    dtype and version counter the entry was prepared from, and is dropped when
    the storage of one of its sources is freed. Writes that bypass the version
    counter (``.data`` writes, writes into inference tensors) are not seen: call
    `clear_prepared_weights` after them.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, sources: tuple[torch.Tensor | None, ...], prepare: Callable[[], object]):
        """The entry of ``sources``, made with ``prepare()`` where there is none."""
        key = tuple(_where(t) for t in sources)
        versions = tuple(_version(t) for t in sources)
        entry = self._entries.get(key)
        if (entry is not None and entry.versions == versions
                and all(ref() is t.untyped_storage()
                        for ref, t in zip(entry.storages, sources) if t is not None)):
            return entry.prepared
        storages = tuple(weakref.ref(t.untyped_storage()) for t in sources if t is not None)
        if entry is not None:
            entry.detach()
        device = next(t.device for t in sources if t is not None)
        prepared = outside_graph_pools(device, prepare)
        entry = _Entry(versions, storages, prepared)
        self._entries[key] = entry
        for t in sources:
            if t is not None:
                finalizer = weakref.finalize(t.untyped_storage(), self._forget, key,
                                             weakref.ref(entry))
                finalizer.atexit = False
                entry.finalizers.append(finalizer)
        return entry.prepared

    def _forget(self, key: tuple, entry_ref: weakref.ref) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry is entry_ref():
            entry.detach()
            del self._entries[key]

    def clear(self) -> None:
        for entry in self._entries.values():
            entry.detach()
        self._entries.clear()
