"""Where a transport backend keeps its state: one communicator per key (process
group and layer shape), the one keyed cache of transport state a backend may keep
(docs/architecture.md, "State"). Closing is collective, so every rank closes in the same
(key) order."""

from __future__ import annotations


class Communicators(dict):
    """Open communicators by key; each has a collective ``close()`` that calls `forget`."""

    def forget(self, key: tuple, communicator) -> None:
        """Drop ``communicator`` if it is still the one filed under ``key``."""
        if self.get(key) is communicator:
            del self[key]

    def opened(self, key: tuple, backend: str, shape: str):
        """The communicator filed under ``key``: the one the dispatch of this layer opened,
        which its combine and gradients follow; ``backend`` and ``shape`` name it in the
        error where none is open."""
        if key not in self:
            raise RuntimeError(f"a2a backend {backend!r}: no communicator is open for {shape}: "
                               "combine and the gradients follow this backend's dispatch of "
                               "the same layer")
        return self[key]

    def close_all(self) -> None:
        """Close every open communicator, in the same order on every rank (collective)."""
        for key in sorted(self):
            self[key].close()

    def in_key_order(self) -> list:
        """The open communicators, in key order."""
        return [self[key] for key in sorted(self)]
