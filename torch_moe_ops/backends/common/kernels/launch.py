"""Triton launches that ``torch.compile`` can see into.

A backend op whose body is traced into the compiled graph (`ops.library.decompose`)
must launch its Triton kernels through ``torch.library.wrap_triton``: Inductor
then compiles and launches them from its own generated code, with none of the
Python launch cost of a call at run time. Eagerly the wrapper only adds
overhead, so kernels launch directly except inside a body wrapped by `traced`::

    launcher(kernel)[grid](*args)      # the kernel itself, or wrap_triton(kernel) when traced

A traced launch must not hand one of its outputs to a second pointer argument, even one
the kernel never reads (`unread_slot`): torch's analysis of which arguments a kernel
writes is conservative, and functionalization replaces each argument it names by a
clone of its own, so the output could end as the clone nothing wrote.

Modules that define Triton kernels import triton (about 0.45 s) when they load:
backends reach them through `on_first_call`, so that importing the library on a
machine that never runs a kernel does not import triton.
"""

from __future__ import annotations

import functools
import importlib

import torch

from torch_moe_ops.backends.common.kernels.tracing import ScopedFlag, fixed_sizes

_TRACED_LAUNCHES = ScopedFlag("torch_moe_ops_traced_launches")


def in_traced_body() -> bool:
    """Whether the caller runs inside a body wrapped by `traced`."""
    return bool(_TRACED_LAUNCHES)


def on_first_call(module: str, name: str):
    """A function that calls ``module.name``, importing ``module`` on its first call."""

    def call(*args):
        return getattr(importlib.import_module(module), name)(*args)

    call.__name__ = call.__qualname__ = name
    return call


def cdiv(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` on the host (grids, padded sizes; a SymInt too).
    Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are constexpr functions whose host
    call costs about 1.5 us, and an experts call makes a dozen of them."""
    return -(-numerator // denominator)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2``, on the host."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def launcher(kernel):
    """``kernel`` as the current caller should launch it (see the module docstring)."""
    return torch.library.wrap_triton(kernel) if in_traced_body() else kernel


def unread_slot(eager: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What fills a pointer argument that a kernel never dereferences (a constexpr leaves
    it out): ``eager`` itself when launched directly (no allocation), and in a traced
    body a one-element ``dtype`` tensor of its own, so that ``eager`` may be an output
    of the same launch. torch (2.11) counts such a slot as written when the kernel
    hands it to a helper, and an output filling it was replaced by an unwritten clone:
    NaN from compiled fp8 layers."""
    if in_traced_body():
        return torch.empty((1, 1), dtype=dtype, device=eager.device)
    return eager


def traced(body):
    """``body`` with its kernels launched through ``wrap_triton``: what a backend
    hands to `ops.decompose_backend_ops`."""

    @functools.wraps(body)
    def run(*args):
        with _TRACED_LAUNCHES.on():
            return body(*args)

    return run


def static_shapes_on_cuda(first: torch.Tensor, *_) -> bool:
    """Whether a call can be traced into the graph: on CUDA (the Triton interpreter
    cannot be traced) and with the first input's sizes fixed, because the
    kernels are chosen from them; a symbolic size leaves the choice to each call."""
    return first.device.type == "cuda" and fixed_sizes(first)
