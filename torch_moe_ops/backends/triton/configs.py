"""Tile sizes of the fused-MoE Triton kernels, kept as data.

Legend: E experts, N expert intermediate size (I), K hidden size (H), M tokens
of one call.

Tuned configs live in ``configs/E={E},N={N},K={K},dtype={dtype},device={device}.json``
beside this module (package data); for quantized weights the file name carries
the format after the dtype, as `QuantSpec.name` writes it
(``...,dtype=bfloat16,quant=fp8_block128x128+fp8_group,device=...json``).
Each file maps a token count to a config:

    {"1": {"path": "direct", "BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 256, "GROUP_M": 1,
           "num_warps": 4, "num_stages": 3}, "64": {...}, ...}

A call with M tokens takes the entry of the largest key <= M (the smallest key
when M is below all of them); with no file for the shape, `default_config`
decides. ``path`` names the kernels a call runs (see `PATHS`); an entry without
one gets `default_path`'s. One config serves both GEMMs of a layer: they must
share BLOCK_M, since one `align_rows` serves both.

Files are read on first use and cached (`functools.lru_cache`), so a warm-up
call with each token count before CUDA-graph capture keeps file reads and
config parsing out of the captured region; nothing else here touches the GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import pathlib

import torch

from torch_moe_ops.config import MXFP4_GROUP, QuantSpec

CONFIG_DIR = pathlib.Path(__file__).parent / "configs"
# The device name used for tensors off CUDA (the Triton interpreter on CPU).
INTERPRETER_DEVICE = "cpu"
# The kernels one call can run:
#   direct      each slot multiplied on its own, no align: 3 launches (4 with K
#               in parts, SPLIT_K), for a few tokens, where each expert gets at
#               most about one slot;
#   tiled       align, then grouped GEMMs over expert-sorted tiles of BLOCK_M rows;
#   grouped_mm  align, then torch._grouped_mm (bf16, sm90+); where it cannot
#               run the call takes `tiled` with this config's tiles;
PATHS = ("direct", "tiled", "grouped_mm")
# Without a tuned file, from this many slots per expert on `grouped_mm` (cuBLAS,
# wgmma) beats the tiled kernels' tl.dot on sm90 in bf16. Measured on an H200
# (2026-11-21) for Mixtral, Qwen3-30B-A3B, OLMoE, GPT-OSS-20B and DeepSeek-V3
# shapes: the crossover lay between 32 and 256 slots per expert, at 128 for most.
GROUPED_MM_MIN_ROWS_PER_EXPERT = 128


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Which kernels one call runs (``path``) and the launch parameters they share.

    The ``direct`` kernels use BLOCK_N (output columns per program), BLOCK_K,
    num_warps, num_stages and SPLIT_K only: SPLIT_K > 1 cuts each GEMM's K into that
    many parts of whole K tiles, each part's programs of its own (more programs where
    a few tokens leave most SMs without one), the parts' fp32 sums added in order by
    the launch that follows. ``path=None`` (an entry of a file that names none) is
    resolved by `get_config`.
    """

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int
    num_warps: int
    num_stages: int
    path: str | None = None
    SPLIT_K: int = 1

    def __post_init__(self) -> None:
        if self.path is not None and self.path not in PATHS:
            raise ValueError(f"path must be one of {', '.join(map(repr, PATHS))} or None, "
                             f"got {self.path!r}")
        for field in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
            value = getattr(self, field)
            # tl.dot needs every dimension of a tile to be a power of two >= 16;
            # the direct kernels reduce with tl.sum, which takes any power of two.
            least = 1 if self.path == "direct" and field != "BLOCK_M" else 16
            if (not isinstance(value, int) or isinstance(value, bool) or value < least
                    or value & (value - 1)):
                raise ValueError(f"{field} must be a power of two >= {least}, got {value!r}")
        for field in ("GROUP_M", "num_warps", "num_stages", "SPLIT_K"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")
        if self.SPLIT_K > 1 and self.path != "direct":
            raise ValueError(f"SPLIT_K must be 1 unless path is 'direct' (only the direct "
                             f"kernels cut K into parts), got {self.SPLIT_K} on path "
                             f"{self.path!r}")


# What the kernels compute in (fp64 has no tensor-core path and is not supported).
KERNEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(E: int, N: int, K: int, dtype: torch.dtype, device_name: str,
                     quant: QuantSpec | None = None) -> str:
    """The tuned file of a shape: ``quant`` (None: unquantized) names the weights'
    format, since each format runs kernels of its own."""
    fmt = "" if quant is None else f",quant={quant.name}"
    return f"E={E},N={N},K={K},dtype={dtype_name(dtype)}{fmt},device={device_name}.json"


def block_k_limits(quant: QuantSpec | None, path: str) -> tuple[int, int | None]:
    """``(least, divides)``: what ``BLOCK_K`` must be for ``quant``'s kernels on
    ``path``: at least ``least``, and a divisor of ``divides`` (or anything).

    fp8 ``tl.dot`` (w8a8, on every path) takes K tiles of 32 and more; one K
    tile of ``fp8_block`` weights must lie in one scale block (``bk``); one of
    mxfp4 must hold whole scale groups of 32 columns.
    """
    if quant is None:
        return 1 if path == "direct" else 16, None
    least = 1 if path == "direct" else 16
    if quant.activations != "none":
        least = 32
    if quant.weights == "mxfp4":
        least = MXFP4_GROUP
    divides = quant.block_size[1] if quant.weights == "fp8_block" else None
    return least, divides


def least_block_n(quant: QuantSpec | None, path: str) -> int:
    """The narrowest ``BLOCK_N`` of ``quant``'s kernels on ``path``: w8a8's direct
    kernels multiply on the tensor cores too, where ``tl.dot`` takes 16 columns
    and more; the other direct kernels reduce with ``tl.sum``."""
    w8a8 = quant is not None and quant.activations != "none"
    return 1 if path == "direct" and not w8a8 else 16


def fits_format(config: KernelConfig, quant: QuantSpec | None) -> bool:
    """Whether ``config``'s tiles suit ``quant``'s kernels (`block_k_limits`,
    `least_block_n`)."""
    least, divides = block_k_limits(quant, config.path)
    return (config.BLOCK_K >= least and (divides is None or divides % config.BLOCK_K == 0)
            and config.BLOCK_N >= least_block_n(quant, config.path))


def fit_block_k(block_k: int, quant: QuantSpec | None, path: str) -> int:
    """The K tile nearest ``block_k`` that suits ``quant``'s kernels on ``path``:
    the deepest power of two <= ``block_k`` dividing ``bk``, and at least the
    least one (`block_k_limits`; `supports` refuses formats where none exists)."""
    least, divides = block_k_limits(quant, path)
    if divides is not None:
        block_k = min(block_k, divides & -divides)
    return max(block_k, least)


@functools.cache
def device_name(device: torch.device) -> str:
    """The name configs are filed under: the CUDA device name with spaces
    replaced by underscores (``NVIDIA_H100_80GB_HBM3``), or ``"cpu"``."""
    if device.type != "cuda":
        return INTERPRETER_DEVICE
    return torch.cuda.get_device_name(device).replace(" ", "_")


def load_config_file(path: pathlib.Path) -> tuple[tuple[int, KernelConfig], ...] | None:
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


@functools.cache
def _tuned_entries(file_name: str) -> tuple[tuple[int, KernelConfig], ...] | None:
    return load_config_file(CONFIG_DIR / file_name)


def pick_entry(entries: tuple[tuple[int, KernelConfig], ...], M: int) -> KernelConfig:
    """The config of the largest token count <= M, or of the smallest one."""
    chosen = entries[0][1]
    for tokens, config in entries:
        if tokens > M:
            break
        chosen = config
    return chosen


def default_path(E: int, M: int, top_k: int, quant: QuantSpec | None = None) -> str:
    """The kernels for M tokens of top_k among E experts, without a tuned file.

    One token, or few enough slots that experts rarely repeat (at most one in
    four experts gets a slot), reads no more weight bytes slot by slot than
    grouped, and saves the align's launches. Quantized weights never take
    ``grouped_mm`` (bf16 only); MXFP4 weights take the tiled kernels there too, which
    read them as fragments (`mxfp4_fragments`), with no decoded copy of the layer (H200,
    2026-11-29, tuned tiles of GPT-OSS-20B: 1631 us at 4096 tokens, where decoding the
    layer to bf16 for ``torch._grouped_mm`` took 2304; 6396 at 16384 against its 6000).
    w8a8 follows the same rule since its direct kernels multiply on the tensor cores (one
    token, H200, 2026-11-23, tuned tiles: 34-38 us direct against 44-46 us tiled at Qwen3
    and OLMoE widths, 112-114 against 132-133 at DeepSeek-V3's, 135 against 132 at
    Mixtral-8x7B's).
    """
    num_slots = M * top_k
    if M == 1 or 4 * num_slots <= E:
        return "direct"
    if quant is None and num_slots >= GROUPED_MM_MIN_ROWS_PER_EXPERT * E:
        return "grouped_mm"
    return "tiled"


def default_config(E: int, N: int, K: int, dtype: torch.dtype, M: int, top_k: int,
                   device_name: str, quant: QuantSpec | None = None) -> KernelConfig:
    """A config for shapes without a tuned file.

    Slots per expert (M * top_k / E) decide BLOCK_M, since few rows waste most
    of a tall tile on padding. fp32 tiles are half as deep: they take twice the
    shared memory per element; fp8 tiles (w8a8) twice as deep, for the same
    reason the other way. ``BLOCK_K`` then fits the format (`fit_block_k`).
    """
    path = default_path(E, M, top_k, quant)
    config = _default_tiles(E, dtype, M, top_k, device_name, quant, path)
    return dataclasses.replace(config, BLOCK_K=fit_block_k(config.BLOCK_K, quant, path))


def _default_tiles(E, dtype, M, top_k, device_name, quant, path) -> KernelConfig:
    if device_name == INTERPRETER_DEVICE:
        # The interpreter runs each program with numpy: the smallest tiles that
        # tl.dot takes cost least, and GROUP_M=2 keeps the grouped order exercised.
        # Quantized kernels call a helper or two per K step, each call costing the
        # interpreter more than a tile's numpy work: fewer, larger tiles.
        wide = 16 if quant is None else 64
        return KernelConfig(BLOCK_M=16, BLOCK_N=wide, BLOCK_K=wide, GROUP_M=2, num_warps=1,
                            num_stages=1, path=path)
    if path == "direct":
        return KernelConfig(BLOCK_M=16, BLOCK_N=32, BLOCK_K=128 if dtype == torch.float32
                            else 256, GROUP_M=1, num_warps=4, num_stages=3, path=path)
    block_k = 32 if dtype == torch.float32 else 64
    if quant is not None and quant.activations != "none":
        block_k = 128
    slots_per_expert = M * top_k / E
    if slots_per_expert <= 8:
        return KernelConfig(BLOCK_M=16, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=1, num_warps=4,
                            num_stages=4, path=path)
    if slots_per_expert <= 64:
        return KernelConfig(BLOCK_M=32, BLOCK_N=64, BLOCK_K=block_k, GROUP_M=4, num_warps=4,
                            num_stages=4, path=path)
    return KernelConfig(BLOCK_M=64, BLOCK_N=128, BLOCK_K=block_k, GROUP_M=8, num_warps=8,
                        num_stages=3, path=path)


@functools.lru_cache(maxsize=4096)
def get_config(E: int, N: int, K: int, dtype: torch.dtype, M: int, top_k: int,
               device_name: str, quant: QuantSpec | None = None) -> KernelConfig:
    """The kernel config for E experts, intermediate size N, hidden size K and
    M tokens of top_k experts each, with weights quantized as ``quant`` says
    (None: in ``dtype``); its ``path`` is never None.

    Reads the tuned table `config_file_name` names on the first call for that
    file, else uses `default_config`. A tuned entry must suit the format
    (`fits_format`): one that does not is an error, not a silent change.
    """
    file_name = config_file_name(E, N, K, dtype, device_name, quant)
    entries = _tuned_entries(file_name)
    if entries is None:
        return default_config(E, N, K, dtype, M, top_k, device_name, quant)
    config = pick_entry(entries, M)
    if config.path is None:
        config = dataclasses.replace(config, path=default_path(E, M, top_k, quant))
    if not fits_format(config, quant):
        least, divides = block_k_limits(quant, config.path)
        raise ValueError(f"bad kernel config file {CONFIG_DIR / file_name}: the tiles of its "
                         f"entry for M={M} (BLOCK_K={config.BLOCK_K}, BLOCK_N={config.BLOCK_N}, "
                         f"path {config.path!r}) do not suit {quant.name}: BLOCK_K at least "
                         f"{least}" + (f" and a divisor of {divides}" if divides else "")
                         + f", BLOCK_N at least {least_block_n(quant, config.path)}")
    return config
