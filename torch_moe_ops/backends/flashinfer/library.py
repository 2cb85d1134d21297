"""Whether flashinfer-python runs here. Its kernels are JIT modules compiled on
first use; asking whether one is built never builds it."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from torch_moe_ops.backends.common import import_failure

INSTALL_HINT = "pip install flashinfer-python"


@functools.cache
def missing() -> str | None:
    """Why ``flashinfer`` cannot be imported here, or ``None`` where it can."""
    return import_failure("flashinfer", f"flashinfer-python is not installed ({INSTALL_HINT})")


def device_reason(device: torch.device, min_capability: tuple[int, int] = (9, 0)) -> str | None:
    """Why flashinfer's kernels cannot run on ``device``, or ``None``."""
    if device.type != "cuda":
        return f"needs a CUDA device, got {device.type}"
    if not torch.cuda.is_available():
        return "needs a CUDA device, this torch sees none"
    capability = torch.cuda.get_device_capability(device)
    if capability < min_capability:
        return (f"needs sm{min_capability[0]}{min_capability[1]} or newer, got "
                f"sm{capability[0]}{capability[1]}")
    return missing()


def built_jit_module(name: str) -> Path | None:
    """The library of FlashInfer's JIT module ``name`` where it is built (an installed
    AOT package's, else the one compiled into FlashInfer's JIT cache), or ``None``.

    Only looks: it neither builds nor writes (FlashInfer's own ``build_and_load``
    would build). Call it where `missing` returned ``None``.
    """
    from flashinfer.jit import env as jit_env

    artifacts = jit_env.get_aot_artifacts(name)
    if artifacts:
        return artifacts[0].path
    path = jit_env.FLASHINFER_JIT_DIR / name / f"{name}.so"
    return path if path.exists() else None
