"""What this backend takes from ``flashinfer.comm``: its functions (imported on first use),
the device their tensors live on, and the check that activations are on it in a dtype they
move. The CPU stand-in of the tests (tests/flashinfer_a2a_emulator.py) replaces `api` and
`DEVICE_TYPE` here; every other module of the backend reaches them through this one."""

from __future__ import annotations

import contextlib
import functools
import types

import torch

from torch_moe_ops.backends.flashinfer import a2a_sizes as sizes

# Where the activations must be (the CPU stand-in of tests/flashinfer_a2a_emulator.py sets "cpu").
DEVICE_TYPE = "cuda"


@functools.cache
def api() -> types.SimpleNamespace:
    """The names of ``flashinfer.comm`` this backend calls, imported on first use."""
    from flashinfer.comm import comm_backend, mapping, mnnvl
    from flashinfer.comm import trtllm_moe_alltoall as alltoall

    return types.SimpleNamespace(
        Mapping=mapping.Mapping, MnnvlConfig=mnnvl.MnnvlConfig, MnnvlMemory=mnnvl.MnnvlMemory,
        TorchDistBackend=comm_backend.TorchDistBackend,
        moe_a2a_get_workspace_size_per_rank=alltoall.moe_a2a_get_workspace_size_per_rank,
        moe_a2a_initialize=alltoall.moe_a2a_initialize,
        moe_a2a_dispatch=alltoall.moe_a2a_dispatch,
        moe_a2a_sanitize_expert_ids=alltoall.moe_a2a_sanitize_expert_ids,
        moe_a2a_combine=alltoall.moe_a2a_combine,
        moe_a2a_get_metainfo_index_pairs=(
            lambda: alltoall.get_moe_alltoall_module().moe_a2a_get_metainfo_index_pairs()))


def on(device: torch.device):
    """``device`` current (flashinfer allocates and launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_activations(name: str, t: torch.Tensor) -> None:
    """Raise where ``t`` (argument ``name``) is not on `DEVICE_TYPE` in a dtype the kernels move."""
    if t.device.type != DEVICE_TYPE:
        raise ValueError(f"{name} must be on a CUDA device for a2a backend 'flashinfer', got "
                         f"{t.device}")
    if t.dtype not in sizes.DTYPES:
        raise ValueError(f"{name} must have dtype in ({', '.join(map(str, sizes.DTYPES))}) for "
                         f"a2a backend 'flashinfer', got {t.dtype}")
