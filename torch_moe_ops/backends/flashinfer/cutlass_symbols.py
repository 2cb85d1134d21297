"""The symbols of the built trimmed fused-MoE module that nothing in it defines, by whose
they are: what a call could reach and find missing.

The trimmed module (`cutlass_spec`) leaves out the runners of the (activation, weight) pairs
the backend never runs, while FlashInfer's binding still names them; it is linked lazily,
so their symbols stay unresolved until something calls them, and a call ends the process
("undefined symbol"). `check` lists the module's undefined symbols of TensorRT-LLM's
kernels (``nm -D --undefined-only``, demangled) and sorts them:

- of a dropped pair's runner (``MoeGemmRunner<A, W, ...>``): expected, never called;
- of a kept pair's runner: the module cannot run that pair (an error);
- anything else of TensorRT-LLM's (a kernel launcher, a helper): unexpected, listed.

Run after a build (``python -m torch_moe_ops.backends.flashinfer build`` and ``status``
print it) and once per process before the backend's first call (`cutlass_module.check_symbols`
raises where a kept pair's runner is missing), so a missing symbol shows as an error that
says how to rebuild, not as a process ended at the first call of a layer. ``dlopen`` with
``RTLD_NOW`` cannot stand in: the dropped runners' symbols are unresolved by design.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
from pathlib import Path

# The pairs the backend runs, as the demangled runner names spell their first two template
# arguments (the sm90 build's Fp4Type is cutlass::float_e2m1_t).
KEPT_PAIRS = {("__nv_bfloat16", "__nv_bfloat16"), ("__nv_bfloat16", "__nv_fp8_e4m3"),
              ("__nv_bfloat16", "cutlass::float_e2m1_t")}
NAMESPACE = "tensorrt_llm::"
# A template argument: a name, or a name with one level of arguments of its own
# (``cutlass::integer_subbyte<4, false>``, as uint4b_t demangles).
_TYPE = r"((?:[^,<>]|<[^<>]*>)+)"
RUNNER = re.compile(rf"MoeGemmRunner<{_TYPE}, {_TYPE}[,>]")


@dataclasses.dataclass(frozen=True)
class SymbolReport:
    """The unresolved symbols of TensorRT-LLM's kernels in one library: ``dropped`` counts
    those of each dropped pair's runner (``"A x W"``); ``kept`` and ``unexpected`` list the
    others. ``ok``: nothing the backend runs is missing."""

    library: Path
    dropped: dict[str, int]
    kept: list[str]
    unexpected: list[str]

    @property
    def ok(self) -> bool:
        return not self.kept and not self.unexpected

    def __str__(self) -> str:
        dropped = ", ".join(f"{pair}: {count}" for pair, count in sorted(self.dropped.items()))
        lines = [(f"unresolved symbols of {self.library.name}: "
                  f"{sum(self.dropped.values())} of dropped pairs' runners (never called; "
                  f"{dropped or 'none'}), {len(self.kept)} of the kept pairs' runners, "
                  f"{len(self.unexpected)} others")]
        for title, names in (("kept pairs' runners (the backend calls these)", self.kept),
                             ("others (a call that reaches one ends the process)",
                              self.unexpected)):
            if names:
                lines.append(f"  {title}:")
                lines += [f"    {name[:300]}" for name in names[:20]]
                if len(names) > 20:
                    lines.append(f"    ... {len(names) - 20} more")
        return "\n".join(lines)


def classify(library: Path, undefined: list[str]) -> SymbolReport:
    """`SymbolReport` of ``library`` whose undefined symbols (demangled) are ``undefined``."""
    dropped: dict[str, int] = {}
    kept, unexpected = [], []
    for name in undefined:
        if NAMESPACE not in name:
            continue  # the C++ runtime's, CUDA's, tvm-ffi's: their libraries define them
        runner = RUNNER.search(name)
        if runner is None:
            unexpected.append(name)
        elif runner.groups() in KEPT_PAIRS:
            kept.append(name)
        else:
            pair = " x ".join(runner.groups())
            dropped[pair] = dropped.get(pair, 0) + 1
    return SymbolReport(library, dropped, kept, unexpected)


def undefined_symbols(library: Path) -> list[str]:
    """The demangled names of ``library``'s undefined dynamic symbols (``nm``, binutils).

    Raises RuntimeError where ``nm`` is missing or fails."""
    nm = shutil.which("nm")
    if nm is None:
        raise RuntimeError("nm (binutils) is not installed: the module's symbols cannot be "
                           "listed")
    result = subprocess.run([nm, "-D", "--undefined-only", "--demangle", str(library)],
                            capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"nm failed on {library}: {result.stderr.strip()}")
    # Each line: "<spaces>U <name>" (a versioned one ends "@VERSION").
    return [line.split(" U ", 1)[1].strip() for line in result.stdout.splitlines()
            if " U " in line]


def check(library: Path) -> SymbolReport:
    """`SymbolReport` of the built module ``library``."""
    return classify(library, undefined_symbols(library))
