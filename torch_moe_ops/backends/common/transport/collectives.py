"""torch.distributed's functional collectives, as the expert-parallel backends use them.

The process group travels by name (``ProcessGroup.group_name``), as it does in
the ops' schemas: the functional collectives take it so, run eagerly, trace
into compiled graphs and capture in CUDA graphs (NCCL), and run on gloo on the CPU.
Every call returns a finished tensor.

Inside a backend body traced into a compiled graph (`launch.traced`), each
collective is one op of its own (``moe_collectives::all_to_all``, ...) with an
ordered effect: Inductor fuses the packing around it, but can neither drop it
(on a rank with no tokens its results feed empty outputs) nor move it past
another collective, so every rank runs the same collectives in the same order.
Eagerly the functional collective is called directly.

Whether an a2a op is traced depends on nothing a rank's own tokens decide: under
``dynamic=True`` Dynamo compiles a rank of 0 or 1 tokens with fixed sizes and its peers
with a symbolic count, and an op left whole on some ranks only would run its eager
kernel's cross-rank check (`ops.group_checks`, one all-reduce) there alone: the ranks'
collectives would no longer match, and they would wait on each other until the timeout.

The ``start_*`` variants issue the same collectives and return the tensor still in flight:
a tensor nothing may read until `wait` (the functional collectives' own ``wait_tensor``, a
node of the graph) has returned it; between the two, the caller's graph places compute that
the transfer then overlaps. They are the functional collectives themselves, traced or not:
Inductor knows that a transfer reads its send buffer until its wait (``_WaitKernel``'s
volatile reads), so it reuses no buffer a transfer still reads, which it cannot know of a
collective inside an op of ours. Their order is the graph's: Inductor moves collectives only
in passes that are off for graphs that move tokens (`lowering.overlap`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torch_moe_ops import torch_compat
from torch_moe_ops.backends.common.kernels.launch import in_traced_body, traced
from torch_moe_ops.config import worst_case_capacity
from torch_moe_ops.ops import decompose_backend_ops
from torch_moe_ops.ops.library import OpContract, define, implement, op_overload

NAMESPACE = "moe_collectives"
_SCHEMA = "(Tensor send, str group_name, int group_size) -> Tensor"
_functional = torch_compat.c10d_functional


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
        return torch_compat.resolve_process_group(group_name)
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


def _check_blocks(send_NX, group_name, group_size, divides=True) -> None:
    if not isinstance(send_NX, torch.Tensor) or send_NX.dim() < 1:
        raise ValueError(f"send must be a tensor of at least 1 dimension, got {send_NX!r}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if divides and send_NX.shape[0] % group_size:
        raise ValueError(f"send.shape[0] must be divisible by group_size ({group_size}), "
                         f"got shape {tuple(send_NX.shape)}")


def _start_all_to_all(send_NX, group_name, group_size):
    splits = [send_NX.shape[0] // group_size] * group_size
    return _functional.all_to_all_single(send_NX.contiguous(), splits, splits, group_name)


def _start_all_gather(local_NX, group_name, group_size):
    return _functional.all_gather_into_tensor(local_NX.contiguous(), group_size, group_name)


def _start_reduce_scatter(full_NX, group_name, group_size):
    return _functional.reduce_scatter_tensor(full_NX.contiguous(), "sum", group_size,
                                             group_name)


def _waited(start):
    def run(send_NX, group_name, group_size):
        return _functional.wait_tensor(start(send_NX, group_name, group_size))

    return run


def _sized(rows):
    def fake(send_NX, group_name, group_size):
        return send_NX.new_empty((rows(send_NX.shape[0], group_size), *send_NX.shape[1:]))

    return fake


_CONTRACTS = {
    contract.name: (contract, _waited(start)) for contract, start in (
        (OpContract(name="all_to_all", schema=_SCHEMA, check=_check_blocks,
                    fake=_sized(lambda n, p: n), ordered=True), _start_all_to_all),
        (OpContract(name="all_gather", schema=_SCHEMA,
                    check=lambda *args: _check_blocks(*args, divides=False),
                    fake=_sized(lambda n, p: n * p), ordered=True), _start_all_gather),
        (OpContract(name="reduce_scatter", schema=_SCHEMA, check=_check_blocks,
                    fake=_sized(lambda n, p: n // p), ordered=True), _start_reduce_scatter),
    )
}
for _contract, _kernel in _CONTRACTS.values():
    define(NAMESPACE, _contract)
    implement(NAMESPACE, _contract, _kernel)


def _collective(name: str, send_NX: torch.Tensor, group_name: str, ep_size: int):
    if in_traced_body():
        return op_overload(NAMESPACE, name)(send_NX, group_name, ep_size)
    return _CONTRACTS[name][1](send_NX, group_name, ep_size)


def all_to_all(send_NX: torch.Tensor, group_name: str, ep_size: int) -> torch.Tensor:
    """Equal blocks: block ``p`` of ``send`` goes to rank ``p``, block ``p`` of the
    result came from rank ``p``."""
    return _collective("all_to_all", send_NX, group_name, ep_size)


def all_gather(local_NX: torch.Tensor, group_name: str, ep_size: int) -> torch.Tensor:
    """``[ep_size * N, ...]``: every rank's ``local`` in rank order."""
    return _collective("all_gather", local_NX, group_name, ep_size)


def reduce_scatter(full_NX: torch.Tensor, group_name: str, ep_size: int) -> torch.Tensor:
    """``[N / ep_size, ...]``: this rank's block of the sum of every rank's ``full``."""
    return _collective("reduce_scatter", full_NX, group_name, ep_size)


def start_all_to_all(send_NX: torch.Tensor, group_name: str, ep_size: int) -> torch.Tensor:
    """`all_to_all`, in flight: read it only through `wait`."""
    _check_blocks(send_NX, group_name, ep_size)
    return _start_all_to_all(send_NX, group_name, ep_size)


def start_all_gather(local_NX: torch.Tensor, group_name: str, ep_size: int) -> torch.Tensor:
    """`all_gather`, in flight: read it only through `wait`."""
    _check_blocks(local_NX, group_name, ep_size, divides=False)
    return _start_all_gather(local_NX, group_name, ep_size)


def start_reduce_scatter(full_NX: torch.Tensor, group_name: str, ep_size: int
                         ) -> torch.Tensor:
    """`reduce_scatter`, in flight: read it only through `wait`."""
    _check_blocks(full_NX, group_name, ep_size)
    return _start_reduce_scatter(full_NX, group_name, ep_size)


# The wait of every ``start_*``: it returns its input, arrived. Inductor and AOTAutograd know
# it (its output aliases its input), so a graph may hold it as a node of its own.
wait = _functional.wait_tensor.default


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


# The kernels that may check the capacity on the host (`_dispatch_traceable`).
_DISPATCHES = ("dispatch", "dispatch_quant")


def _dispatch_traceable(hidden_TH, topk_weights_TK, topk_ids_TK, num_experts, *args) -> bool:
    """For ``dispatch`` and ``dispatch_quant``: both end with the same four arguments."""
    _, _, max_tokens_per_rank, capacity = args[-4:]
    # Below the worst case, dispatch reads the overflow check on the host: it stays one op,
    # run eagerly inside the compiled graph, on every rank (the capacity is the layer's).
    return capacity >= worst_case_capacity(max_tokens_per_rank, topk_ids_TK.shape[1])


def _always(*_) -> bool:
    return True


def trace_into_graphs(namespace: str, kernels: dict) -> None:
    """Under ``torch.compile``, trace an a2a backend's kernels (its ``dispatch``,
    ``combine``, their gradients and ``dispatch_quant``) into the graph, where Inductor
    fuses the packing and unpacking around the ordered collectives: with fixed and with
    symbolic token counts alike (see the module docstring)."""
    dispatches = {name: traced(kernel) for name, kernel in kernels.items()
                  if name in _DISPATCHES}
    decompose_backend_ops(namespace, dispatches, _dispatch_traceable)
    decompose_backend_ops(namespace, {name: traced(kernel) for name, kernel in kernels.items()
                                      if name not in _DISPATCHES}, _always)


def trace_in_flight_into_graphs(namespace: str, kernels: dict, contracts: dict) -> None:
    """`trace_into_graphs` for an a2a backend's chunked ops (`ops.tokens_in_flight`, their
    ``contracts`` by name), every call: a window of a symbolic token count guards the
    count against the window's bounds (a recompile, which runs no collective), where a call
    left whole on one rank would run a collective its peers do not."""
    decompose_backend_ops(namespace, {name: traced(kernel) for name, kernel in kernels.items()},
                          _always, contracts)
