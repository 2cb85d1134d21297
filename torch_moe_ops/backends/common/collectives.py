"""torch.distributed's functional collectives, as the expert-parallel backends use them.

The process group travels by name (``ProcessGroup.group_name``), as it does in
the ops' schemas: the functional collectives take it so, run eagerly, trace
into compiled graphs and capture in CUDA graphs (NCCL), and run on gloo on the CPU.
Every call returns a finished tensor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

_functional = torch.ops._c10d_functional


def supports(spec, problem, device) -> str | None:
    """What every torch.distributed a2a backend needs (the registry's ``supports``):
    torch.distributed, and a layer with expert parallelism where that is known."""
    if not dist.is_available():
        return "this torch has no torch.distributed"
    if problem.ep_size is not None and problem.ep_size < 2:
        return "needs expert parallelism (ep_size > 1); a2a 'none' runs one device"
    return None


def group_of(group_name: str) -> dist.ProcessGroup:
    """The process group ``group_name`` names; a clear error when there is none."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(f"group_name must name a live process group, got {group_name!r} "
                         f"(torch.distributed is not initialised: call "
                         f"dist.init_process_group first)")
    try:
        return distributed_c10d._resolve_process_group(group_name)
    except (KeyError, ValueError, RuntimeError) as error:
        raise ValueError(f"group_name must name a live process group, got {group_name!r} "
                         f"({error})") from error


def rank_in(group_name: str, ep_size: int) -> int:
    """This process's rank in the group, checked against the ``ep_size`` the op was given."""
    group = group_of(group_name)
    if group.size() != ep_size:
        raise ValueError(f"ep_size must equal the size of group {group_name!r} "
                         f"({group.size()}), got {ep_size}")
    return group.rank()


def all_to_all(send_NX: torch.Tensor, group_name: str, ep_size: int) -> torch.Tensor:
    """Equal blocks: block ``p`` of ``send`` goes to rank ``p``, block ``p`` of the
    result came from rank ``p``."""
    block = send_NX.shape[0] // ep_size
    splits = [block] * ep_size
    return _functional.wait_tensor(
        _functional.all_to_all_single(send_NX.contiguous(), splits, splits, group_name))


def all_gather(local_NX: torch.Tensor, group_name: str, ep_size: int) -> torch.Tensor:
    """``[ep_size * N, ...]``: every rank's ``local`` in rank order."""
    return _functional.wait_tensor(
        _functional.all_gather_into_tensor(local_NX.contiguous(), ep_size, group_name))


def reduce_scatter(full_NX: torch.Tensor, group_name: str, ep_size: int) -> torch.Tensor:
    """``[N / ep_size, ...]``: this rank's block of the sum of every rank's ``full``."""
    return _functional.wait_tensor(
        _functional.reduce_scatter_tensor(full_NX.contiguous(), "sum", ep_size, group_name))


def check_capacity(needed: torch.Tensor, capacity: int, group_name: str, what: str) -> None:
    """Raise on every rank if any rank needs more than ``capacity`` rows.

    One all-reduce and a host read: callers run it only with a capacity below
    the worst case (the default never overflows, and stays free of host syncs).
    Every rank takes the same decision, so none is left waiting in a collective.
    """
    most = _functional.wait_tensor(
        _functional.all_reduce(needed.max().reshape(1).to(torch.int64), "max", group_name))
    if int(most) > capacity:
        raise RuntimeError(f"{what}: {int(most)} rows, but ep_capacity is {capacity}; no "
                           f"row was dropped, the call failed on every rank: raise "
                           f"ep_capacity (up to the worst case) or lower the tokens per rank")
