"""The SM90 CUTLASS fused-MoE JIT module the ``flashinfer`` experts backend runs:
whether it is built, building it on purpose, how far a build has got, and pointing
FlashInfer's ``cutlass_fused_moe`` at it. Nothing here builds unless `build` is called.

FlashInfer compiles the kernels of ``cutlass_fused_moe`` into one JIT module on first
use: on sm90 ``fused_moe_90``, 248 CUDA objects for every dtype pair, about 45
minutes on 16 cores. This package builds a trimmed copy instead,
``torch_moe_ops_fused_moe_90`` (`cutlass_spec`: bf16, fp8 128 x 128 blocks and
mxfp4 W4A16 only, 54 objects), and `use_trimmed_module` makes ``cutlass_fused_moe``
load it, so FlashInfer's full module is never built. Its build is still long, so the
``flashinfer`` experts backend never lets a call start it by surprise: its ``supports`` refuses
until the module is built (`not_built_reason`), unless ``TORCH_MOE_OPS_FLASHINFER_BUILD=1``
opts in to building on first use. Building it on purpose, on the GPU machine that
will run it (nvcc and ninja needed; the target is that GPU's architecture, or
``FLASHINFER_CUDA_ARCH_LIST``)::

    python -m torch_moe_ops.backends.flashinfer build     # foreground
    scripts/flashinfer_build.sh                           # detached, logs to a file
    python -m torch_moe_ops.backends.flashinfer status    # how far it has got; once built,
                                                          # which symbols it leaves unresolved

or ``torch_moe_ops.backends.flashinfer.build()``. The module lands in FlashInfer's JIT
cache (``~/.cache/flashinfer/<version>/<arch>/cached_ops/<module>/``;
``FLASHINFER_WORKSPACE_BASE`` moves it). Its build file records the compiler flags,
and FlashInfer checks it with ninja on each process's first call: run with the
``FLASHINFER_*`` settings it was built with (``FLASHINFER_NVCC_THREADS``,
``FLASHINFER_JIT_DEBUG``, ``FLASHINFER_JIT_VERBOSE``, which also turns debug builds
on, ``FLASHINFER_CUDA_ARCH_LIST``), or that first call compiles it again.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from pathlib import Path

from torch_moe_ops.backends.flashinfer import cutlass_spec, cutlass_symbols, library
from torch_moe_ops.backends.registry import REGISTRY

BUILD_ENV = "TORCH_MOE_OPS_FLASHINFER_BUILD"
BUILD_COMMAND = "python -m torch_moe_ops.backends.flashinfer build"
DETACHED_COMMAND = "scripts/flashinfer_build.sh"
# Measured on an H200 host (2026-11-26): 54 objects with 32 parallel compilations.
BUILD_TIME = "about 13 minutes with 32 parallel compilations; more on fewer cores"


def build_opted_in() -> bool:
    """Whether ``TORCH_MOE_OPS_FLASHINFER_BUILD=1`` lets a first call build the module."""
    return os.environ.get(BUILD_ENV) == "1"


def module_name() -> str:
    """The trimmed module's name for the current GPU (`cutlass_spec.module_name`)."""
    return cutlass_spec.module_name()


def use_trimmed_module() -> None:
    """Make FlashInfer's ``cutlass_fused_moe`` build and load the trimmed module on sm90
    in place of its full one, from its next first load on (it keeps a module once
    loaded). Only the backend's three pairs run there (`cutlass_spec`)."""
    from flashinfer.fused_moe import core

    # cutlass_fused_moe reaches its sm90 spec through this name of its module.
    core.gen_cutlass_fused_moe_sm90_module = _trimmed_sm90_spec


@functools.cache
def check_symbols() -> None:
    """Once per process, before the backend first calls the built module: raise RuntimeError
    where it leaves a symbol of a runner the backend calls unresolved (`cutlass_symbols`),
    which would end the process at that call. Checks nothing where the module is not built
    yet (built on first use: `build` prints the check) or ``nm`` cannot read it."""
    path = built_path()
    if path is None:
        return
    try:
        report = cutlass_symbols.check(path)
    except RuntimeError:
        return
    if report.kept:
        raise RuntimeError(f"FlashInfer's fused-MoE module {path} cannot run the kernels the "
                           f"flashinfer experts backend calls: {report}\nRebuild it with "
                           f"`{BUILD_COMMAND}` after removing {path.parent}")


def _trimmed_sm90_spec(use_fast_build: bool = False):
    # use_fast_build compiles the same kernels (cutlass_spec.trimmed_spec): not read.
    return cutlass_spec.trimmed_spec()


def built_path() -> Path | None:
    """The built module's library, or ``None``: only looks (`library.built_jit_module`)."""
    return library.built_jit_module(module_name())


def not_built_reason() -> str | None:
    """Why a call cannot run FlashInfer's fused MoE without building it first, or
    ``None`` where the module is built or building on first use is opted in."""
    if build_opted_in() or built_path() is not None:
        return None
    return (f"the SM90 fused-MoE module ({module_name()}) is not built, and building it "
            f"takes long ({BUILD_TIME}), so no call builds it implicitly: build it "
            f"once with `{BUILD_COMMAND}` (or `{DETACHED_COMMAND}`, detached), or set "
            f"{BUILD_ENV}=1 to let the first call build it")


def build(verbose: bool = True) -> Path:
    """Compile the trimmed SM90 fused-MoE module (`cutlass_spec.trimmed_spec`) into
    FlashInfer's JIT cache (a module already built is only checked, in seconds), load
    it once, and return the library's path. ``verbose`` prints ninja's progress (``[n/N]``
    per object).

    Raises RuntimeError where flashinfer-python does not import.
    """
    reason = library.missing()
    if reason is not None:
        raise RuntimeError(f"cannot build FlashInfer's fused-MoE module: {reason}")
    name = module_name()
    path = built_path()
    if path is not None and path != _build_dir(name) / f"{name}.so":
        return path  # An installed AOT package's: nothing to compile.
    # The spec use_trimmed_module gives cutlass_fused_moe: another set of flags would
    # be rebuilt by the first call.
    spec = cutlass_spec.trimmed_spec()
    spec.build(verbose=verbose, need_lock=True)
    spec.load()
    # Built, the backend runs where `not_built_reason` said it did not: choose again.
    REGISTRY.changed()
    return spec.get_library_path()


def _build_dir(name: str) -> Path:
    from flashinfer.jit import env as jit_env

    return jit_env.FLASHINFER_JIT_DIR / name


@dataclasses.dataclass(frozen=True)
class BuildProgress:
    """How far a build of the module has got: ``objects_done`` of ``objects_total``
    compiled (0 of 0 before a build wrote its build file), ``library`` once built."""

    module: str
    build_dir: Path
    objects_done: int
    objects_total: int
    library: Path | None

    def __str__(self) -> str:
        if self.library is not None:
            return f"{self.module}: built, {self.library}"
        if not self.objects_total:
            return (f"{self.module}: not built, no build started in {self.build_dir} "
                    f"(start one with `{DETACHED_COMMAND}` or `{BUILD_COMMAND}`)")
        return (f"{self.module}: not built yet, {self.objects_done} of {self.objects_total} "
                f"objects compiled in {self.build_dir}")


def progress() -> BuildProgress:
    """`BuildProgress` of the module, read from its build file and the objects beside it."""
    name = module_name()
    build_dir = _build_dir(name)
    ninja_path = build_dir / "build.ninja"
    objects = []
    if ninja_path.exists():
        # FlashInfer's build file: "build <object>: compile|cuda_compile <source>".
        for line in ninja_path.read_text().splitlines():
            target, _, rule = line.partition(": ")
            if target.startswith("build ") and rule.split(" ")[0] in ("compile", "cuda_compile"):
                objects.append(Path(target.removeprefix("build ")))
    done = sum(path.exists() for path in objects)
    return BuildProgress(name, build_dir, done, len(objects), built_path())


def symbols_line(library: Path) -> tuple[bool, str]:
    """``(ok, report)``: `cutlass_symbols.check` of the built ``library`` (ok: nothing the
    backend runs is unresolved), or why it could not be checked (not ok)."""
    try:
        report = cutlass_symbols.check(library)
    except RuntimeError as error:
        return False, f"symbols not checked: {error}"
    return report.ok, str(report)


USAGE = f"""usage: python -m torch_moe_ops.backends.flashinfer {{build,status}}

  build   compile the trimmed SM90 fused-MoE module ({BUILD_TIME}) into FlashInfer's JIT cache,
          in the foreground ({DETACHED_COMMAND} runs it detached, logging to a file), then
          list the symbols it leaves unresolved
  status  whether it is built (and its unresolved symbols), or how many of its objects a
          build has compiled

Exit status: 0 built with every symbol the backend calls defined, 3 not built, 4 built with
one of them (or something else of TensorRT-LLM's) unresolved or unchecked."""


def main(argv: list[str]) -> int:
    """The command line: ``build``, ``status`` or ``--help``; returns the exit status."""
    if argv in (["--help"], ["-h"]):
        print(USAGE)
        return 0
    if len(argv) != 1 or argv[0] not in ("build", "status"):
        print(USAGE, file=sys.stderr)
        return 2
    reason = library.missing()
    if reason is not None:
        print(f"flashinfer: {reason}", file=sys.stderr)
        return 1
    if argv[0] == "build":
        library_path = build()
        print(f"built: {library_path}")
    else:
        state = progress()
        print(state)
        if state.library is None:
            return 3
        library_path = state.library
    ok, report = symbols_line(library_path)
    print(report)
    return 0 if ok else 4
