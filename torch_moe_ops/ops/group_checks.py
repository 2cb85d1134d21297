"""One answer per expert-parallel group to an op's argument checks.

An op that moves tokens between ranks (its schema takes ``ep_size`` and ``group_name``)
runs collectives: if its checks failed on one rank only, that rank would raise while its
peers waited in the op's first collective until the process group's timeout. Where the
ranks' check results are cheap to agree on, every rank takes part in one all-reduce of
"did a check fail here" before any collective of the op: the rank whose check failed
raises its own error, the others raise one that names the op and the group.

Cheap means: the op's tensors are on the CPU (gloo: the all-reduce is a host call), or
``TORCH_MOE_OPS_CHECK_VALUES=1`` is set (it already buys host syncs for the id checks).
Elsewhere (CUDA without that flag) the agreement would add a host sync to every eager call,
so it is not made: a check that fails on one rank raises there, and its peers wait until
the group's timeout. Checks made while compiling (on fake tensors) fail the compile of the
rank whose sizes are wrong; its peers, compiled, wait in the graph's first collective until
the timeout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from torch_moe_ops import torch_compat
from torch_moe_ops.ops.checks import value_checks_enabled


def _named(op: torch_compat.OpOverload, args: tuple, name: str):
    names = [a.name for a in torch_compat.schema(op).arguments]
    return args[names.index(name)] if name in names else None


def agreed(op: torch_compat.OpOverload, args: tuple, check: Callable[[], None]) -> None:
    """``check()``, with every rank of ``op``'s group raising where it fails on any rank
    (and the agreement is cheap, see the module docstring)."""
    ep_size, group_name = _named(op, args, "ep_size"), _named(op, args, "group_name")
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
    if (not ep_size or ep_size < 2 or device is None or not value_checks_enabled(device)
            or not dist.is_available() or not dist.is_initialized()):
        check()
        return
    try:
        check()
        error = None
    except (ValueError, RuntimeError, TypeError) as raised:
        error = raised
    try:
        group = torch_compat.resolve_process_group(group_name)
    except (KeyError, ValueError, RuntimeError):
        # No such group: the check names it (collectives.group_of), on every rank alike.
        if error is not None:
            raise error from None
        return
    failed = torch.tensor([int(error is not None)], dtype=torch.int32, device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if int(failed.item()):
        raise RuntimeError(f"{op.name()}: the argument checks failed on another rank of "
                           f"group {group_name!r} (that rank raised the reason); every rank "
                           "raises so that none waits in the op's collectives")
