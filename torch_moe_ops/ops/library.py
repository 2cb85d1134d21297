"""One place that turns an op contract into `torch.library` registrations.

An `OpContract` is what every implementation of an op shares: the schema, the
argument checks, the fake kernel and the autograd formula. The generic op
(``moe::<name>``) and each backend's concrete op (``moe_triton::<name>``, ...)
are defined from the same contract, so the lowering can swap one for the other
without changing a size, a stride or a gradient.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import torch

from torch_moe_ops import torch_compat
from torch_moe_ops.ops import group_checks

GENERIC_NAMESPACE = "moe"
# The reference backend's namespace (`torch_moe_ops.backends.reference` defines
# its ops): where a gradient runs when the namespace that ran forward has none.
REFERENCE_NAMESPACE = "moe_reference"


@dataclasses.dataclass(frozen=True)
class OpContract:
    """What every implementation of one op shares.

    ``check(*args)`` validates shapes and dtypes (it sees fake tensors too);
    ``check_values(*args)`` validates tensor contents and only sees real tensors;
    ``ordered`` ops (collectives) keep their order in compiled graphs and are
    never dropped, even where a rank's outputs are empty: every rank must run the
    same collectives in the same order. ``fake(*args)`` allocates the outputs;
    ``backward``/``setup_context`` follow `torch.library.register_autograd`, and
    ``backward`` finds the namespace of the op that ran forward in ``ctx.namespace``.
    """

    name: str
    schema: str
    check: Callable[..., None]
    fake: Callable[..., object]
    check_values: Callable[..., None] | None = None
    backward: Callable[..., object] | None = None
    setup_context: Callable[..., None] | None = None
    tags: tuple = ()
    ordered: bool = False


_LIBRARIES: dict[str, torch.library.Library] = {}
# The Python kernel `implement` registered for each op, by qualified name.
_KERNELS: dict[str, Callable] = {}


def _library(namespace: str) -> torch.library.Library:
    # torch.library.Library objects unregister their ops when collected: keep one
    # per namespace for the life of the process.
    if namespace not in _LIBRARIES:
        _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBRARIES[namespace]


def qualified_name(namespace: str, contract: OpContract) -> str:
    return f"{namespace}::{contract.name}"


def op_overload(namespace: str, name: str) -> torch_compat.OpOverload:
    return getattr(getattr(torch.ops, namespace), name).default


def kernel_of(namespace: str, name: str) -> Callable | None:
    """The kernel `implement` registered as ``namespace::name`` (it checks the
    arguments it is given, in schema order), or None. Called directly, it skips
    the dispatcher and the op's autograd wrapper: for a caller that is itself an
    op's kernel, below autograd already (the generic ops' eager kernels)."""
    return _KERNELS.get(f"{namespace}::{name}")


def defines(namespace: str, name: str) -> bool:
    """Whether the op ``namespace::name`` is defined in this process."""
    return hasattr(getattr(torch.ops, namespace), name)


@functools.cache
def argument_index(namespace: str, name: str, argument: str) -> int:
    """The position of ``argument`` among ``namespace::name``'s, in schema order."""
    return [a.name for a in _arguments(op_overload(namespace, name))].index(argument)


@functools.cache
def _arguments(op: torch_compat.OpOverload) -> tuple:
    # Read once: the schema builds a new list of its arguments on every access (~5 us),
    # and every eager call of an op reads it.
    return tuple(torch_compat.schema(op).arguments)


def full_args(op: torch_compat.OpOverload, args: tuple, kwargs: dict) -> tuple:
    """``args`` and ``kwargs`` of a call of ``op`` as one positional tuple in schema
    order, defaults filled in: what the contract's functions and kernels take."""
    arguments = _arguments(op)
    if not kwargs and len(args) == len(arguments):
        return args
    full = list(args)
    for argument in arguments[len(args):]:
        if argument.name in kwargs:
            full.append(kwargs[argument.name])
        elif argument.has_default_value():
            full.append(argument.default_value)
        else:
            raise TypeError(f"{op} is missing argument {argument.name!r}")
    return tuple(full)


def named_args(op: torch_compat.OpOverload, args: tuple, kwargs: dict | None = None
               ) -> dict[str, object]:
    """``args`` and ``kwargs`` of a call of ``op`` by the schema's argument names, defaults
    filled in (`full_args`). Code that reads an argument by name keeps reading it when
    the schema gains an argument or moves one; a position would silently shift."""
    return dict(zip(_argument_names(op), full_args(op, args, kwargs or {})))


@functools.cache
def output_index(op: torch_compat.OpOverload) -> dict[str, int]:
    """The position of each of ``op``'s outputs in the tuple it returns, by the schema's
    name for it: code that picks outputs reads them by name, as `named_args` reads
    arguments."""
    return {output.name: i for i, output in enumerate(torch_compat.schema(op).returns)}


@functools.cache
def _argument_names(op: torch_compat.OpOverload) -> tuple[str, ...]:
    # Cached as `_arguments` is: each name read from the schema costs ~0.2 us.
    return tuple(argument.name for argument in _arguments(op))


# The Python types an eager call may pass for each schema type without the dispatcher's
# conversion or complaint; a call with any other takes the op's path, whose error it gets.
_PLAIN_TYPES = {"Tensor": (torch.Tensor, torch.nn.Parameter), "int": (int,),
                "float": (float, int), "bool": (bool,), "str": (str,),
                "ScalarType": (torch.dtype,), "List[int]": (list, tuple)}


@functools.cache
def _plain_types(op: torch_compat.OpOverload) -> tuple[tuple[tuple[type, ...], bool], ...]:
    # Per argument: the types `_PLAIN_TYPES` allows, and whether None is allowed.
    kinds = []
    for argument in _arguments(op):
        real_type = argument.real_type
        optional = isinstance(real_type, torch.OptionalType)
        name = str(real_type.getElementType() if optional else real_type)
        # A type not listed allows no value: such a call takes the op's path.
        kinds.append((_PLAIN_TYPES.get(name, ()), optional))
    return tuple(kinds)


def runs_eagerly(op: torch_compat.OpOverload, args: tuple) -> bool:
    """Whether the call ``op(*args)`` (every argument given, positionally) may skip the
    dispatcher and run ``op``'s kernel directly, with the same result: nothing traces it
    (`torch_compat.op_calls_intercepted`), no gradient can flow through it (grad mode off,
    or no tensor argument requires grad), every tensor is a plain ``torch.Tensor`` (or
    ``Parameter``) on the CPU or a CUDA device (the devices `implement` registers), and
    every other argument has a type its schema takes as it is."""
    if torch_compat.op_calls_intercepted():
        return False
    kinds = _plain_types(op)
    if len(args) != len(kinds):
        return False
    grad = torch.is_grad_enabled()
    for arg, (types, optional) in zip(args, kinds):
        if arg is None:
            if not optional:
                return False
        elif type(arg) not in types:
            return False
        elif isinstance(arg, torch.Tensor):
            if not (arg.is_cuda or arg.is_cpu) or (grad and arg.requires_grad):
                return False
        elif type(arg) in (list, tuple) and any(type(item) is not int for item in arg):
            return False
    return True


def call(packet: torch_compat.OpOverloadPacket, *args):
    """``packet(*args)`` (every argument given, positionally), or where the call of its
    default overload `runs_eagerly`, the Python kernel `implement` registered for it
    called directly.

    The direct call skips what an eager call of the op costs on the host above its
    kernel (torch's dispatcher, torch.library's autograd wrapper, and the Dynamo-disable
    wrapper around the kernel: 20-40 us per call on an H200 host) and does what the
    op would: the kernel checks its arguments (the same errors), and the generic ops'
    kernels choose their backend as an op call does (`backends.EagerChoices`). Where a
    gradient, a trace or a compiler could see the call, the op runs, so autograd
    records it and compiled graphs hold it (as the packet, as a direct call would)."""
    if torch.compiler.is_compiling():
        # First, and nothing else: Dynamo puts the op in the graph and reads no further.
        return packet(*args)
    op = packet.default
    kernel = _KERNELS.get(torch_compat.schema(op).name)
    if kernel is not None and runs_eagerly(op, args):
        return kernel(*args)
    return packet(*args)


def define(namespace: str, contract: OpContract) -> torch_compat.OpOverload:
    """Define ``namespace::contract.name`` with the contract's schema, fake and autograd."""
    qualname = qualified_name(namespace, contract)
    _library(namespace).define(contract.name + contract.schema, tags=contract.tags)
    op = op_overload(namespace, contract.name)

    def fake(*args, **kwargs):
        args = full_args(op, args, kwargs)
        contract.check(*args)
        return contract.fake(*args)

    torch.library.register_fake(qualname, fake, lib=_library(namespace))
    if contract.ordered:
        # An ordered effect threads a token through the op in traced graphs:
        # Inductor can neither remove it (an idle rank's outputs are empty) nor
        # move it past the next collective.
        torch_compat.register_ordered_effect(op)
    if contract.backward is not None:
        def setup_context(ctx, inputs, output):
            # A gradient that needs the forward's backend (a transport's reverse
            # direction) calls ``ctx.namespace``'s op, not the generic one.
            ctx.namespace = namespace
            contract.setup_context(ctx, full_args(op, tuple(inputs), {}), output)

        torch.library.register_autograd(qualname, contract.backward,
                                        setup_context=setup_context, lib=_library(namespace))
    return op


def implement(namespace: str, contract: OpContract, kernel: Callable,
              device_types: tuple[str, ...] = ("cpu", "cuda"), checked: bool = True) -> None:
    """Register ``kernel`` as ``namespace::contract.name`` for ``device_types``.

    The kernel receives arguments that already passed the contract's checks,
    unless ``checked=False``: for a kernel that only forwards to another op
    defined from the same contract, which checks them itself.
    """
    op = op_overload(namespace, contract.name)

    def check(args):
        contract.check(*args)
        if contract.check_values is not None:
            contract.check_values(*args)

    def checked_kernel(*args, **kwargs):
        args = full_args(op, args, kwargs)
        if checked:
            if contract.ordered:
                # Collectives follow: one rank's failure must be every rank's.
                group_checks.agreed(op, args, lambda: check(args))
            else:
                check(args)
        return kernel(*args)

    _KERNELS[qualified_name(namespace, contract)] = checked_kernel
    torch.library.register_kernel(qualified_name(namespace, contract), device_types,
                                  checked_kernel, lib=_library(namespace))


def decompose(namespace: str, contract: OpContract, body: Callable,
              applies: Callable[..., bool]) -> None:
    """Under ``torch.compile``, trace ``body`` into the graph in place of the op
    ``namespace::contract.name``, for calls where ``applies(*args)`` holds.

    AOTAutograd functionalizes below autograd: the op keeps its own backward
    (the contract's), while its forward becomes the torch ops and
    ``wrap_triton`` kernel launches of ``body``, which Inductor fuses and
    launches from its generated code instead of calling the op's Python kernel
    at run time. This is what ``torch.library.triton_op`` does, on an op
    defined from our contract. Where ``applies`` is False (e.g. a token count
    left symbolic, whose kernels are chosen per call) the op stays one node.
    Eager calls are untouched.
    """
    traced_types = (torch_compat.FakeTensor, torch_compat.FunctionalTensor)

    def rule(mode, op, types, args, kwargs):
        if any(not issubclass(t, traced_types) and t is not torch.Tensor for t in types):
            # Another tensor subclass is involved: let it handle the op first.
            return NotImplemented
        args = full_args(op, args, kwargs)
        if not applies(*args):
            return mode.__torch_dispatch__(op, types, args, {})
        with mode:
            return body(*args)

    torch.library.register_torch_dispatch(qualified_name(namespace, contract),
                                          torch_compat.FunctionalTensorMode, rule,
                                          lib=_library(namespace))
