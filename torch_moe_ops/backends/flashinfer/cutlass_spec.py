"""The build spec of this package's trimmed copy of FlashInfer's SM90 fused-MoE module:
FlashInfer's sources, flags and kernel generator, with only the kernels the
``flashinfer`` experts backend runs.

FlashInfer's ``fused_moe_90`` compiles every (activation, weight) pair its binding
knows (fp8 x uint4, fp8 x fp4, fp4 x fp4, fp16 x ..., bf16 x uint8, ...): 248
objects, 220 of them generated kernel instantiations. The backend runs three pairs,
each one ``CutlassMoeFCRunner`` of FlashInfer's binding:

- bf16 x bf16 (``MoeGemmRunner<bf16, bf16>``, its sm90 TMA and sm80 kernels);
- the 128 x 128 fp8 block-scaled path: bf16 activations with fp8 weights
  (``MoeGemmRunner<bf16, fp8>``), whose GEMMs run in ``fp8_blockscale_gemm.cu``;
- bf16 x mxfp4, the W4A16 path (``MoeGemmRunner<bf16, fp4>``, its mixed-input kernels).

`trimmed_spec` keeps those runners' sources, the shared ones, and the generated
kernels whose activation and weight types are bf16 x bf16 or bf16 x fp4, for
sm90a only, under this package's own module name (`module_name`), in its own
generated-source folder: FlashInfer's full module is never built from it.

The binding and ``cutlass_fused_moe_instantiation.cu`` still name the runners of the
dropped pairs. Their calls into the dropped objects stay unresolved in the library;
FlashInfer loads it lazily (``dlopen(RTLD_LAZY)``, and the link asks for
``-z lazy``), so they resolve only if called: a dropped pair must never be
called through this module (a call ends the process with "undefined symbol").
`cutlass_symbols` lists what the built module leaves unresolved, after each build.

Legend: op, one kernel instantiation of FlashInfer's generator.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

PREFIX = "torch_moe_ops_"
ARCH = "90"
# The per-pair runner sources of FlashInfer's module that the three pairs need;
# every other moe_gemm_kernels_*.cu is dropped.
KEPT_RUNNERS = ("moe_gemm_kernels_bf16_bf16.cu", "moe_gemm_kernels_bf16_fp8.cu",
                "moe_gemm_kernels_bf16_fp4.cu")
RUNNER_PREFIX = "moe_gemm_kernels_"
# The (activation, weight) type names of the generated kernels that those runners
# launch (FlashInfer's generator's DataType names; "e2m1" is fp4).
KEPT_OP_TYPES = {("bf16", "bf16"), ("bf16", "e2m1")}
# FlashInfer's generator functions whose ops are filtered (the sm80 ones are the
# non-TMA kernels that the sm90 runners fall back to).
OP_GENERATORS = ("generate_sm90_operations", "generate_sm80_operations")
GENERATED_SUFFIX = ".generated.cu"
# Lazy binding where a toolchain defaults to -z now: see the module docstring.
LAZY_LDFLAG = "-Wl,-z,lazy"


def module_name() -> str:
    """This package's name for the module: FlashInfer's sm90 name (``fused_moe_90``,
    or its H20 variant) behind ``torch_moe_ops_``."""
    from flashinfer.jit import fused_moe as jit_fused_moe

    h20 = getattr(jit_fused_moe, "_should_enable_sm90_moe_prebuilt_d_descriptor", None)
    return PREFIX + ("fused_moe_90_h20_prebuilt_d" if h20 is not None and h20()
                     else f"fused_moe_{ARCH}")


def _type_name(data_type) -> str:
    # The generator's DataType members have names; its fp4 is an object of class e2m1_type.
    name = getattr(data_type, "name", None)
    return name if name is not None else type(data_type).__name__.removesuffix("_type")


def op_types(op) -> tuple[str, str]:
    """``(activation, weight)`` type names of one of FlashInfer's generated ops (its sm80
    ops carry one ``dtype`` for both)."""
    if hasattr(op, "act_type"):
        return _type_name(op.act_type), _type_name(op.weight_type)
    return _type_name(op.dtype), _type_name(op.dtype)


def kept_op(op) -> bool:
    """Whether the trimmed module compiles ``op``."""
    return op_types(op) in KEPT_OP_TYPES


@contextlib.contextmanager
def _kept_ops_only(generate_kernels):
    """FlashInfer's generator, for the duration, emitting the kept ops only: its own
    grouping of ops into files and its file writer stay as they are."""
    originals = {name: getattr(generate_kernels, name) for name in OP_GENERATORS}

    def filtered(generate):
        return lambda *args: [op for op in generate(*args) if kept_op(op)]

    try:
        for name, generate in originals.items():
            setattr(generate_kernels, name, filtered(generate))
        yield
    finally:
        for name, generate in originals.items():
            setattr(generate_kernels, name, generate)


def generated_dir() -> Path:
    """Where the trimmed module's kernel instantiations are written (not FlashInfer's
    folder: its generator removes files it did not write this time)."""
    from flashinfer.jit import env as jit_env

    return jit_env.FLASHINFER_GEN_SRC_DIR / "cutlass_instantiations" / module_name()


def generate_kernels() -> list[Path]:
    """Write the kept ops' instantiation files with FlashInfer's generator; return them."""
    from flashinfer.jit.gemm.cutlass import generate_kernels as generator

    out_dir = generated_dir()
    out_dir.mkdir(parents=True, exist_ok=True)
    with _kept_ops_only(generator):
        generator.generate_gemm_operations(out_dir, f"{ARCH};{ARCH}-real")
    return sorted(out_dir.rglob("*" + GENERATED_SUFFIX))


def dropped_source(path: Path) -> bool:
    """Whether ``path``, a source of FlashInfer's full spec, is left out: a runner of a
    dropped pair, or one of FlashInfer's own generated files (ours replace them)."""
    name = path.name
    if name.endswith(GENERATED_SUFFIX):
        return True
    return name.startswith(RUNNER_PREFIX) and name not in KEPT_RUNNERS


def trimmed_spec():
    """The trimmed module's ``JitSpec``: FlashInfer's sm90 spec (its flags, include
    folders and shared sources as they are; ``use_fast_build`` off, as
    ``cutlass_fused_moe`` builds it) with the dropped pairs' sources left out, the
    kept ops' instantiations in, and this package's module name.

    Writes generated sources (FlashInfer's full set in its folder, the kept set in
    `generated_dir`), compiles nothing. ``use_fast_build`` is not used: it only
    narrows the tactics of the host-side heuristic (``-DFAST_BUILD`` reaches the
    C++ sources, not the CUDA ones), so it compiles the same kernels.
    """
    from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module

    full = gen_cutlass_fused_moe_sm90_module()
    kernels = generate_kernels()
    full_generated = {path.parent for path in full.sources
                      if path.name.endswith(GENERATED_SUFFIX)}
    # FlashInfer's generated folder is one of its include folders: ours stands in.
    full_generated_root = {path for path in full.extra_include_dirs
                           if any(Path(path) in folder.parents for folder in full_generated)}
    include_dirs = [generated_dir() if path in full_generated_root else path
                    for path in full.extra_include_dirs]
    sources = [path for path in full.sources if not dropped_source(path)] + kernels
    return dataclasses.replace(full, name=module_name(), sources=sources,
                               extra_include_dirs=include_dirs,
                               extra_ldflags=[*(full.extra_ldflags or []), LAZY_LDFLAG])
