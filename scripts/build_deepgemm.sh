#!/usr/bin/env bash
# Build DeepGEMM (github.com/deepseek-ai/DeepGEMM at 54e2261, 2.6.1: the fp8 grouped GEMMs the
# `deepgemm` experts backend calls) in place from the source packed in .peers/, and print how
# long it took. Nothing is downloaded: the source travels git-ignored. Sourced, it exports
# PYTHONPATH (the built package) and DG_JIT_CACHE_DIR (DeepGEMM compiles each kernel with nvcc
# on first use and keeps it there).
#
# Pack the source once, on a machine that has the three repositories' git objects (the
# archive is about 1.3 MiB: CUTLASS and {fmt} are the submodules DeepGEMM pins, headers only):
#   mkdir -p /tmp/dg/third-party/cutlass/include /tmp/dg/third-party/fmt
#   git --git-dir=<DeepGEMM>/.git archive 54e2261 | tar -x -C /tmp/dg
#   git --git-dir=<cutlass>/.git archive f3fde58372d33e9a5650ba7b80fc48b3b49d40c8:include \
#     | tar -x -C /tmp/dg/third-party/cutlass/include
#   git --git-dir=<fmt>/.git archive 553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28 include \
#     | tar -x -C /tmp/dg/third-party/fmt
#   tar -cJf .peers/deepgemm-src.tar.xz -C /tmp/dg .
#
# DeepGEMM's setup.py needs the `wheel` package and git; the extension is one C++ file, built
# here with torch's BuildExtension directly. A kernel cache carried as .peers/deepgemm-cache.tgz
# (what scripts/deepgemm_gpu_check.sh brings back in $OUT) skips the nvcc runs. Meant to be
# sourced (it returns 1 where the build fails); run as a script it builds and checks.
_dg_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DG_SRC="${DG_SRC:-/tmp/deepgemm}"
_dg_build() {
  [ -f "$_dg_root/.peers/deepgemm-src.tar.xz" ] \
    || { echo "no .peers/deepgemm-src.tar.xz: see the top of scripts/build_deepgemm.sh"; return 1; }
  if PYTHONPATH="$DG_SRC" python3 -c "import deep_gemm" >/dev/null 2>&1; then
    echo "DeepGEMM already built in $DG_SRC"
    return 0
  fi
  rm -rf "$DG_SRC" && mkdir -p "$DG_SRC"
  tar -xJf "$_dg_root/.peers/deepgemm-src.tar.xz" -C "$DG_SRC"
  # The JIT compiles against deep_gemm/include: CUTLASS's headers go beside DeepGEMM's.
  ln -sfn "$DG_SRC/third-party/cutlass/include/cutlass" "$DG_SRC/deep_gemm/include/cutlass"
  ln -sfn "$DG_SRC/third-party/cutlass/include/cute" "$DG_SRC/deep_gemm/include/cute"
  local start=$SECONDS
  (cd "$DG_SRC" && MAX_JOBS="$(nproc)" python3 - build_ext --inplace >"$DG_SRC/build.log" 2>&1 <<'EOF'
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

abi = int(torch.compiled_with_cxx11_abi())
# Absolute: ninja compiles from the build folder.
here = os.getcwd()
setup(name="deep_gemm", ext_modules=[CUDAExtension(
    name="deep_gemm._C", sources=[f"{here}/csrc/python_api.cpp"],
    include_dirs=[f"{CUDA_HOME}/include", f"{CUDA_HOME}/include/cccl",
                  f"{here}/deep_gemm/include", f"{here}/third-party/cutlass/include",
                  f"{here}/third-party/fmt/include"],
    libraries=["cudart", "nvrtc"], library_dirs=[f"{CUDA_HOME}/lib64"],
    extra_compile_args=["-std=c++17", "-O3", "-fPIC", "-Wno-psabi",
                        "-Wno-deprecated-declarations", f"-D_GLIBCXX_USE_CXX11_ABI={abi}"],
    # Its JIT parses includes with std::regex, which crashed (SIGSEGV compiling the pattern,
    # torch 2.11+cu130 image, g++ 13.3) when the extension's libstdc++ references resolved
    # to the process's: it keeps a libstdc++ of its own, bound and hidden inside it.
    extra_link_args=["-static-libstdc++", "-Wl,-Bsymbolic", "-Wl,--exclude-libs,ALL"])],
    cmdclass={"build_ext": BuildExtension})
EOF
  ) || { tail -40 "$DG_SRC/build.log"; return 1; }
  echo "DeepGEMM built in $(( SECONDS - start )) s"
}
_dg_build || return 1 2>/dev/null || exit 1
export PYTHONPATH="$DG_SRC${PYTHONPATH:+:$PYTHONPATH}"
export DG_JIT_CACHE_DIR="${DG_JIT_CACHE_DIR:-/tmp/deepgemm-cache}"
mkdir -p "$DG_JIT_CACHE_DIR"
if [ -f "$_dg_root/.peers/deepgemm-cache.tgz" ]; then
  tar -xzf "$_dg_root/.peers/deepgemm-cache.tgz" -C "$DG_JIT_CACHE_DIR"
fi
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__, deep_gemm.__file__)"
