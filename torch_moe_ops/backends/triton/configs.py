"""Tile sizes of the fused-MoE Triton kernels, kept as data.

Legend: E experts, N expert intermediate size (I), K hidden size (H), M tokens
of one call.

Tuned configs live in ``configs/E={E},N={N},K={K},dtype={dtype},device={device}.json``
beside this module (package data). Each file maps a token count to a config:

    {"1": {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1,
           "num_warps": 4, "num_stages": 4}, "64": {...}, ...}

A call with M tokens takes the entry of the largest key <= M (the smallest key
when M is below all of them); with no file for the shape, `default_config`
decides. One config serves both GEMMs of a layer: they must share BLOCK_M,
since one `align_rows` serves both.

Files are read on first use and cached (`functools.lru_cache`), so a warm-up
call with each token count before CUDA-graph capture keeps file reads and
config parsing out of the captured region; nothing else here touches the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib
from typing import Optional

import torch

CONFIG_DIR = pathlib.Path(__file__).parent / "configs"
# The device name used for tensors off CUDA (the Triton interpreter on CPU).
INTERPRETER_DEVICE = "cpu"


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Launch parameters shared by the two grouped GEMMs of one call."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int

    def __post_init__(self) -> None:
        for field in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            value = getattr(self, field)
            # tl.dot needs every dimension of a tile to be a power of two >= 16.
            if not isinstance(value, int) or value < 16 or value & (value - 1):
                raise ValueError(f"{field} must be a power of two >= 16, got {value!r}")
        for field in ("GROUP_M", "num_warps", "num_stages"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(E: int, N: int, K: int, dtype: torch.dtype, device_name: str) -> str:
    return f"E={E},N={N},K={K},dtype={dtype_name(dtype)},device={device_name}.json"


@functools.lru_cache(maxsize=None)
def device_name(device: torch.device) -> str:
    """The name configs are filed under: the CUDA device name with spaces
    replaced by underscores (``NVIDIA_H100_80GB_HBM3``), or ``"cpu"``."""
    if device.type != "cuda":
        return INTERPRETER_DEVICE
    return torch.cuda.get_device_name(device).replace(" ", "_")


def load_config_file(path: pathlib.Path) -> Optional[tuple[tuple[int, KernelConfig], ...]]:
    """The ``(token count, config)`` entries of one file, ascending; None if it does not exist."""
    if not path.is_file():
        return None
    with open(path) as f:
        table = json.load(f)
    try:
        entries = tuple(sorted((int(m), KernelConfig(**entry)) for m, entry in table.items()))
    except (TypeError, ValueError) as e:
        raise ValueError(f"bad kernel config file {path}: {e}") from e
    if not entries:
        raise ValueError(f"kernel config file {path} holds no entry")
    return entries


@functools.lru_cache(maxsize=None)
def _tuned_entries(file_name: str) -> Optional[tuple[tuple[int, KernelConfig], ...]]:
    return load_config_file(CONFIG_DIR / file_name)


def pick_entry(entries: tuple[tuple[int, KernelConfig], ...], M: int) -> KernelConfig:
    """The config of the largest token count <= M, or of the smallest one."""
    chosen = entries[0][1]
    for tokens, config in entries:
        if tokens > M:
            break
        chosen = config
    return chosen


def default_config(E: int, N: int, K: int, dtype: torch.dtype, M: int,
                   device_name: str) -> KernelConfig:
    """A config for shapes without a tuned file.

    Rows per expert (M * top_k / E, with top_k unknown here: M / E) decide
    BLOCK_M, since few rows waste most of a tall tile on padding. fp32 tiles
    are half as deep: they take twice the shared memory per element.
    """
    if device_name == INTERPRETER_DEVICE:
        # The interpreter runs each program with numpy: the smallest tiles that
        # tl.dot takes cost least, and GROUP_M=2 keeps the grouped order exercised.
        return KernelConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1,
                            num_stages=1)
    block_k = 32 if dtype == torch.float32 else 64
    if M <= E:
        return KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=1, num_warps=4,
                            num_stages=4)
    if M <= 16 * E:
        return KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=4, num_warps=4,
                            num_stages=4)
    return KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=8,
                        num_stages=3)


@functools.lru_cache(maxsize=4096)
def get_config(E: int, N: int, K: int, dtype: torch.dtype, M: int,
               device_name: str) -> KernelConfig:
    """The kernel config for E experts, intermediate size N, hidden size K and M tokens.

    Reads ``configs/E={E},N={N},K={K},dtype={dtype},device={device_name}.json``
    on the first call for that file (a tuned table), else uses `default_config`.
    """
    entries = _tuned_entries(config_file_name(E, N, K, dtype, device_name))
    if entries is None:
        return default_config(E, N, K, dtype, M, device_name)
    return pick_entry(entries, M)
