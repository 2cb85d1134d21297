"""What a backend body traced into a compiled graph (`ops.library.decompose`) may ask.

- Whether the graph is for Inductor (`for_inductor`): Inductor fuses a traced
  body into generated code, ``aot_eager`` runs it op by op. A body that is fast
  only fused (the ``cpu`` backend's per-slot gather, which Inductor folds into
  its loads and which op by op would copy expert weights) applies only inside
  `for_inductor`, which the compile backend enters around Inductor's compilation.
- Whether a tensor's sizes are fixed (`fixed_sizes`): bodies that choose their
  kernels from the sizes are traced only then; a symbolic size leaves the choice
  to each call.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch


class ScopedFlag:
    """A bool that ``with flag.on():`` sets for the code the block runs.

    A context variable: threads and nested traces each see their own, and
    nothing outlives the block, so it is no process state.
    """

    def __init__(self, name: str):
        self._var = contextvars.ContextVar(name, default=False)

    def __bool__(self) -> bool:
        return self._var.get()

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        token = self._var.set(True)
        try:
            yield
        finally:
            self._var.reset(token)


_FOR_INDUCTOR = ScopedFlag("torch_moe_ops_tracing_for_inductor")


def tracing_for_inductor() -> bool:
    """True inside `for_inductor`."""
    return bool(_FOR_INDUCTOR)


def for_inductor():
    """A context inside which traced bodies may assume Inductor compiles what they trace."""
    return _FOR_INDUCTOR.on()


def fixed_sizes(t: torch.Tensor) -> bool:
    """Whether every size of ``t`` is a plain int (none symbolic) in this trace."""
    return all(isinstance(s, int) for s in t.shape)
