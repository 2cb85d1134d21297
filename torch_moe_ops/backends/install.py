"""How to install the libraries that the optional backends run on.

``python -m torch_moe_ops.backends.install [deepep|deepgemm|flashinfer]`` prints the steps;
`tmo.backend(..., device=...)` names this command when a backend it is given
cannot run because its library is missing.
"""

from __future__ import annotations

import importlib.util
import sys

from torch_moe_ops.backends.flashinfer.cutlass_module import BUILD_COMMAND, BUILD_TIME

# Backend name -> (the module its library installs, the steps).
LIBRARIES = {
    "deepep": ("deep_ep", """\
DeepEP (github.com/deepseek-ai/DeepEP), for the a2a backend 'deepep' on NVLink GPUs
(sm90). PyPI's deep_ep has no kernels: build it from its source, with the CUDA
toolkit (nvcc) and the torch it will run with already installed:

    pip install nvidia-nvshmem-cu12   # nvidia-nvshmem-cu13 for CUDA 13; DeepEP's setup.py
                                      # finds it (without NVSHMEM: no low-latency kernels)
    git clone https://github.com/deepseek-ai/DeepEP && cd DeepEP
    git checkout 29d31c0              # the deep_ep.Buffer API the backend calls
    TORCH_CUDA_ARCH_LIST=9.0 pip install --no-build-isolation --no-deps .
    python -c "import deep_ep"

With CUDA 13, put libcu++'s headers on the include path first:

    export CPLUS_INCLUDE_PATH=/usr/local/cuda/include/cccl
    export NVCC_APPEND_FLAGS=-I/usr/local/cuda/include/cccl
"""),
    "deepgemm": ("deep_gemm", """\
DeepGEMM (github.com/deepseek-ai/DeepGEMM), for the experts backend 'deepgemm' (fp8
128 x 128 blocks on sm90). It is built from source with the CUDA toolkit (nvcc) and the
torch it will run with; its kernels compile with nvcc on first use:

    git clone --recursive https://github.com/deepseek-ai/DeepGEMM && cd DeepGEMM
    git checkout 54e2261 && git submodule update --init   # 2.6.1, the API the backend calls
    ./install.sh
    python -c "import deep_gemm"

Where its first kernel call dies with SIGSEGV inside std::regex (seen with torch 2.11
built for CUDA 13 and g++ 13), link libstdc++ into its extension instead:
scripts/build_deepgemm.sh in this repository does (-static-libstdc++ -Wl,-Bsymbolic
-Wl,--exclude-libs,ALL), from a source archive, with no network.
"""),
    "flashinfer": ("flashinfer", f"""\
FlashInfer, for the experts, a2a and route backends 'flashinfer' (CUDA sm90; routing sm89):

    pip install flashinfer-python

Its kernels compile on first use, in seconds, except the CUTLASS fused MoE of
experts='flashinfer', which is built only on request (a trimmed copy of
FlashInfer's module; its build takes {BUILD_TIME}):

    {BUILD_COMMAND}
"""),
}


def install_hint(name: str) -> str | None:
    """Where to read how to install backend ``name``'s library when it is missing, else None."""
    module = LIBRARIES.get(name, (None,))[0]
    if module is not None and importlib.util.find_spec(module) is None:
        return (f"{module} is not installed here (python -m torch_moe_ops.backends.install "
                f"{name} says how)")
    return None


def main(argv: list[str]) -> int:
    names = argv or list(LIBRARIES)
    unknown = [name for name in names if name not in LIBRARIES]
    if unknown:
        print(f"backend must be one of {', '.join(LIBRARIES)}, got {', '.join(unknown)}",
              file=sys.stderr)
        return 2
    print("\n".join(LIBRARIES[name][1] for name in names), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
