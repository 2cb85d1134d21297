"""What several backends run, none of them a backend, in two sub-packages:

- `kernels`: the computation of experts and of rows (the sort by expert, moving rows
  between frames, the gated activations, the grouped GEMMs and their gradient, the
  Triton epilogues) and how a traced backend body launches Triton kernels.
- `transport`: moving tokens between ranks (torch.distributed's collectives, the
  keyed cache of communicators, fp8 dispatch on any rows transport, the routing beside
  each token of the tokens format).
  `transport.collectives` defines the ops of namespace ``moe_collectives`` (one op
  per collective, with an ordered effect, for traced backend bodies).

`transport` imports `kernels`, never the reverse. Backends import from here and
never from each other.
"""

from __future__ import annotations

import importlib
import importlib.util

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def import_failure(module: str, not_installed: str) -> str | None:
    """Why the optional library ``module`` cannot be imported here (``not_installed`` where
    it is absent, else the import's own error), or ``None`` where it can."""
    if importlib.util.find_spec(module) is None:
        return not_installed
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 (any import failure is the reason)
        return f"import {module} failed: {type(error).__name__}: {error}"
    return None
