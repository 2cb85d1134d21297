#!/usr/bin/env bash
# Build DeepEP (github.com/deepseek-ai/DeepEP at 29d31c0, the NVSHMEM `deep_ep.Buffer` API
# that the `deepep` a2a backend calls) from the source in .peers/DeepEP, for sm90, and
# print how long it took. Nothing is downloaded: the source travels in .peers/ (git-ignored).
#
# Prepare the source once, on a machine that has DeepEP's git objects (about 2 MiB):
#   mkdir -p .peers/DeepEP
#   git --git-dir=<DeepEP clone>/.git archive 29d31c095796f3c8ece47ee9cdcc167051bbeed9 \
#     | tar -x -C .peers/DeepEP
#
# NVSHMEM comes from pip (nvidia-nvshmem-cu12/-cu13: site-packages/nvidia/nvshmem, or
# NVSHMEM_DIR if set); libcu++ headers from /usr/local/cuda/include/cccl (CUDA 13 keeps
# them off the default include path).
#   MODE=inplace (default): build_ext --inplace; then PYTHONPATH=.peers/DeepEP imports
#     deep_ep (this script prints the export line). A build in place that imports is kept;
#     FORCE=1 rebuilds.
#   MODE=pip: pip install --no-build-isolation --no-deps into the current environment.
#   PACK=1 with $OUT set: also writes $OUT/deep_ep_build.tgz (the built extension), to
#     unpack into .peers/DeepEP on a fresh machine instead of building again.
set -euo pipefail
cd "$(dirname "$0")/.."
SRC="${DEEPEP_SRC:-.peers/DeepEP}"
MODE="${MODE:-inplace}"
CCCL="${CCCL_INCLUDE:-/usr/local/cuda/include/cccl}"
[ -f "$SRC/setup.py" ] || { echo "no DeepEP source in $SRC: see the top of $0"; exit 1; }

imports() {
  PYTHONPATH="$SRC${PYTHONPATH:+:$PYTHONPATH}" python3 -c \
    "import deep_ep; print('deep_ep', deep_ep.__file__, 'sm90:', deep_ep.Buffer.is_sm90_compiled())"
}
if [ "$MODE" = inplace ] && [ "${FORCE:-0}" != 1 ] && ls "$SRC"/deep_ep_cpp*.so >/dev/null 2>&1 \
    && imports; then
  echo "DeepEP already built in $SRC; export PYTHONPATH=$SRC\${PYTHONPATH:+:\$PYTHONPATH}"
  exit 0
fi

wheel_dir=$(python3 -c "import nvidia.nvshmem as m; print(list(m.__path__)[0])" 2>/dev/null || true)
if [ -z "${NVSHMEM_DIR:-}" ] && [ -n "$wheel_dir" ]; then
  if [ -e "$wheel_dir/lib/libnvshmem_host.so" ]; then
    export NVSHMEM_DIR="$wheel_dir"
  else
    # The wheel ships only libnvshmem_host.so.N: DeepEP's setup.py finds the wheel itself
    # (nvidia.nvshmem) and links that name when NVSHMEM_DIR is unset.
    echo "NVSHMEM: pip wheel at $wheel_dir (found by setup.py; links its libnvshmem_host.so.N)"
  fi
fi
[ -n "${NVSHMEM_DIR:-}" ] && echo "NVSHMEM_DIR=$NVSHMEM_DIR"
[ -n "${NVSHMEM_DIR:-}$wheel_dir" ] || echo "warning: no NVSHMEM found: DeepEP builds without" \
  "its low-latency and internode kernels"
[ -d "$CCCL" ] || echo "warning: $CCCL is missing (CUDA 13 needs it for <cuda/std/...>)"
export CPATH="$CCCL${CPATH:+:$CPATH}"
export CPLUS_INCLUDE_PATH="$CCCL${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-I$CCCL"
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

start=$(date +%s)
case "$MODE" in
  inplace) (cd "$SRC" && python3 setup.py build_ext --inplace) ;;
  pip) python3 -m pip install --no-build-isolation --no-deps "$SRC" ;;
  *) echo "MODE must be inplace or pip, got $MODE"; exit 1 ;;
esac
echo "DeepEP built in $(( $(date +%s) - start )) s (MODE=$MODE, TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
if [ "$MODE" = inplace ]; then
  imports
  echo "export PYTHONPATH=$SRC\${PYTHONPATH:+:\$PYTHONPATH}"
  if [ "${PACK:-0}" = 1 ] && [ -n "${OUT:-}" ]; then
    tar czf "$OUT/deep_ep_build.tgz" -C "$SRC" $(cd "$SRC" && ls deep_ep_cpp*.so)
    echo "packed $OUT/deep_ep_build.tgz"
  fi
else
  python3 -c "import deep_ep; print('deep_ep', deep_ep.__file__)"
fi
