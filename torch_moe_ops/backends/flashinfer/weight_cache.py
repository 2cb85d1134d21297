"""Prepared copies of a layer's weights, kept by their source tensors: by (tensor,
version), as DESIGN asks of a backend whose kernels read another layout. The
``flashinfer`` experts backend keeps its one cache here (`WeightCache`)."""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable

import torch

from torch_moe_ops import torch_compat


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


class WeightCache:
    """Prepared weights by their source tensors, as DESIGN asks: by (tensor, version).

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
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Kernels do not run during capture: a copy made now would hold garbage.
            raise RuntimeError("experts backend 'flashinfer' converts a layer's weights on "
                               "its first call, which cannot be captured in a CUDA graph: "
                               "run the layer once before capturing (or after changing its "
                               "weights)")
        storages = tuple(weakref.ref(t.untyped_storage()) for t in sources if t is not None)
        if entry is not None:
            entry.detach()
        entry = _Entry(versions, storages, prepare())
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
