"""The private torch APIs the library relies on, each named once here.

None of these is public or stable: a torch release may move or change any of
them. Each is tested (tests/test_torch_compat.py: it exists and behaves as
relied upon) on the torch versions in `TESTED_ON`: 2.11 on the GPU machines,
2.13 on the CPU. When a release breaks one, the fix goes here, and the other
modules keep calling the name they call now.
"""

from __future__ import annotations

import torch
from torch._ops import OpOverload, OpOverloadPacket
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

TESTED_ON = ("2.11", "2.13")

__all__ = ["TESTED_ON", "FakeTensor", "FunctionalTensor", "FunctionalTensorMode", "OpOverload",
           "OpOverloadPacket", "below_autograd", "c10d_functional", "inductor_compiler",
           "lookup_backend", "packet_name", "register_ordered_effect", "resolve_process_group",
           "schema", "tensor_version"]

# torch's functional collectives (all_to_all_single, all_gather_into_tensor,
# reduce_scatter_tensor, all_reduce, wait_tensor): they take the group by name,
# run eagerly and trace into compiled graphs.
c10d_functional = torch.ops._c10d_functional


def schema(op: OpOverload) -> torch.FunctionSchema:
    """The op's schema: its arguments, in order, with their names and defaults."""
    return op._schema


def packet_name(packet: OpOverloadPacket) -> str:
    """``"namespace::name"`` of an op packet (``torch.ops.moe.experts``)."""
    return packet._qualified_op_name


def register_ordered_effect(op: OpOverload) -> None:
    """Give ``op`` an ordered effect: traced graphs thread a token through it, so
    that neither Dynamo nor Inductor removes it or moves it past another such op."""
    from torch._higher_order_ops.effects import _EffectType, _register_effectful_op

    _register_effectful_op(op, _EffectType.ORDERED)


def below_autograd():
    """A context in which torch calls skip their autograd kernels (as a kernel
    registered below autograd runs): for an op whose gradient is its own formula."""
    return torch._C._AutoDispatchBelowADInplaceOrView()


def resolve_process_group(group_name: str):
    """The live ``ProcessGroup`` named ``group_name`` (``ProcessGroup.group_name``)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._resolve_process_group(group_name)


def inductor_compiler(mode: str | None, options: dict):
    """Inductor as ``torch.compile(backend="inductor", mode=mode, options=options)``
    runs it: a ``(graph_module, example_inputs) -> callable`` that applies ``mode``
    (``"reduce-overhead"``: CUDA graphs) as well as ``options``."""
    return torch._TorchCompileInductorWrapper(mode, options, None)


def lookup_backend(name: str):
    """The ``torch.compile`` backend registered under ``name`` (``"eager"``, ``"aot_eager"``)."""
    return torch._dynamo.lookup_backend(name)


def tensor_version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, which every in-place write bumps; None for an
    inference tensor (made under ``torch.inference_mode``), which has none."""
    return None if tensor.is_inference() else tensor._version
