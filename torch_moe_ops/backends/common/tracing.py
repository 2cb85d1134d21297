"""Whether the graph being traced is for Inductor: some traced bodies only pay off fused.

A backend op can be traced into the compiled graph (`ops.library.decompose`):
its forward becomes the torch ops of a body. Inductor fuses them into generated
code; ``aot_eager`` runs them one by one. A body that is fast only fused (the
``cpu`` backend's per-slot gather, which Inductor folds into its loads and which
op by op would copy expert weights) applies only inside `for_inductor`, which
the compile backend enters around Inductor's compilation.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

# Scoped to the compilation that sets it (a context variable): not process state.
_FOR_INDUCTOR = contextvars.ContextVar("torch_moe_ops_tracing_for_inductor", default=False)


def tracing_for_inductor() -> bool:
    """True inside `for_inductor`."""
    return _FOR_INDUCTOR.get()


@contextlib.contextmanager
def for_inductor() -> Iterator[None]:
    """Inside, traced bodies may assume Inductor compiles what they trace."""
    token = _FOR_INDUCTOR.set(True)
    try:
        yield
    finally:
        _FOR_INDUCTOR.reset(token)
