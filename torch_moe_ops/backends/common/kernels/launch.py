"""Triton launches that ``torch.compile`` can see into.

A backend op whose body is traced into the compiled graph (`ops.library.decompose`)
must launch its Triton kernels through ``torch.library.wrap_triton``: Inductor
then compiles and launches them from its own generated code, with none of the
Python launch cost of a call at run time. Eagerly the wrapper only adds
overhead, so kernels launch directly except inside a body wrapped by `traced`::

    launcher(kernel)[grid](*args)      # CachedLaunches(kernel), or wrap_triton(kernel) when traced

Eagerly, Triton's own launch (``JITFunction.run``) binds and specializes every
argument again on each call (about 20-30 us of host time per launch on an H200 host);
`CachedLaunches` keeps the compiled kernel of each specialization it has launched
and launches it again directly.

Modules that define Triton kernels import triton (about 0.45 s) when they load:
backends reach them through `on_first_call`, so that importing the library on a
machine that never runs a kernel does not import triton.
"""

from __future__ import annotations

import functools
import importlib
import os

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


def launcher(kernel):
    """``kernel`` as the current caller should launch it (see the module docstring): through
    ``wrap_triton`` inside a traced body, else through its `CachedLaunches` (the kernel
    itself under the Triton interpreter, whose kernels are not compiled)."""
    if in_traced_body():
        return torch.library.wrap_triton(kernel)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return kernel
    return _cached_launches(kernel)


# Each kernel's launcher, by the kernel's id: the entry holds the kernel, so no other
# kernel can take its id. (A JITFunction hashes by its source's digest.)
_LAUNCHES: dict[int, object] = {}


def _cached_launches(kernel):
    """``kernel``'s `CachedLaunches`, or ``kernel`` itself where it is not a plain
    ``JITFunction`` (an autotuner, a heuristics wrapper)."""
    launches = _LAUNCHES.get(id(kernel))
    if launches is None:
        from triton.runtime.jit import JITFunction

        launches = _LAUNCHES[id(kernel)] = (
            CachedLaunches(kernel) if type(kernel) is JITFunction else kernel)
    return launches


def _tensor_class(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tensor.data_ptr() % 16 == 0


def _int_class(value: int) -> tuple:
    return value == 1, value % 16 == 0, -2**31 <= value < 2**31, value < 2**63


# What Triton's launch specializes a non-constexpr argument on (triton/runtime/jit.py,
# native_specialize_impl and BaseBackend.get_*_specialization, 3.4 to 3.9): a tensor on its
# dtype and on its address being a multiple of 16; an int on being 1 (then a constant),
# on being a multiple of 16 and on its width (i32, i64 or u64); a float, a bool and None
# on their type alone. Each argument's class as keyed here tells apart whatever Triton
# tells apart (more, where a parameter is not specialized). An argument of a type not
# listed (a tensor subclass, a tuple, a descriptor) is launched by Triton itself.
_ARG_CLASSES = {torch.Tensor: _tensor_class, torch.nn.Parameter: _tensor_class, int: _int_class,
                float: type, bool: type, type(None): type}
_UNKNOWN = object()


def _arg_class(arg):
    classify = _ARG_CLASSES.get(type(arg))
    return _UNKNOWN if classify is None else classify(arg)


class CachedLaunches:
    """``kernel[grid](*args, **kwargs)``, with the compiled kernel of each specialization
    launched once kept and launched again directly, skipping Triton's binding and
    specialization of every argument (``JITFunction.run``).

    A launch's key is what Triton's specialization reads: the current device, each
    positional argument's class (`_ARG_CLASSES`), the keyword arguments (constexprs and
    options such as ``num_warps``, by value) and the settings ``JITFunction.run`` reads
    into the compile options. The stream is read on each launch, and the global values
    the kernel reads are checked as Triton checks them. Triton launches itself (and
    nothing is kept) with a callable grid, an argument of a type not listed, a parameter
    left to its default, a pre-run or stage-inspection hook, or a Triton whose objects
    lack what this calls.
    """

    def __init__(self, kernel) -> None:
        from triton import knobs
        from triton.runtime.driver import driver

        self.kernel = kernel
        self._knobs = knobs
        self._driver = driver
        # key -> (compiled kernel, names of the parameters the keyword arguments fill).
        self.compiled: dict[tuple, tuple] = {}

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs) -> None:
        kernel, knobs = self.kernel, self._knobs
        if (callable(grid) or kernel.pre_run_hooks or self._globals_changed()
                or getattr(knobs.runtime, "add_stages_inspection_hook", None) is not None):
            kernel[grid](*args, **kwargs)
            return
        device = self._driver.active.get_current_device()
        classes = tuple(map(_arg_class, args))
        key = (device, classes, tuple(kwargs.items()), knobs.runtime.debug,
               getattr(knobs.compilation, "instrumentation_mode", None),
               getattr(knobs.compilation, "fpsan_homomorphic_casts", None))
        entry = self.compiled.get(key)
        if entry is None:
            compiled = kernel[grid](*args, **kwargs)
            if _UNKNOWN not in classes:
                self._keep(key, compiled, len(args), kwargs)
            return
        compiled, keyword_params = entry
        values = (*args, *(kwargs[name] for name in keyword_params))
        stream = self._driver.active.get_current_stream(device)
        grid_3d = (*grid, 1, 1)
        compiled.run(grid_3d[0], grid_3d[1], grid_3d[2], stream, compiled.function,
                     compiled.packed_metadata, compiled.launch_metadata(grid, stream, *values),
                     knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *values)

    def _globals_changed(self) -> bool:
        # Triton raises on such a launch (a global read at compile time has changed):
        # its own launch does.
        return any(namespace.get(name, _UNKNOWN) != value for (name, _), (value, namespace)
                   in self.kernel.used_global_vals.items())

    def _keep(self, key: tuple, compiled, num_positional: int, kwargs: dict) -> None:
        names = getattr(self.kernel, "arg_names", None)
        launchable = names is not None and all(hasattr(compiled, name) for name in (
            "run", "function", "packed_metadata", "launch_metadata"))
        if launchable and set(names[num_positional:]) <= kwargs.keys():
            self.compiled[key] = (compiled, tuple(names[num_positional:]))


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
