#!/usr/bin/env bash
# Fills the ignored .peers/flashinfer/ for a GPU machine that reaches no registry:
# flashinfer-python's Python package and the sources its routing, all-to-all and
# fused-MoE JIT modules compile, CUTLASS's tools/util headers included (trimmed: the
# whole wheel is near the 64 MiB a call carries),
# plus the wheels it imports for Python $PY (default 3.12).
# install_on_device.sh unpacks them into /tmp/site.
set -euo pipefail
PY=${PY:-3.12}
VERSION=${VERSION:-0.7.2}
dest=.peers/flashinfer
work=$(mktemp -d)
mkdir -p "$dest"
python3 -m pip download -q --no-deps -d "$work" "flashinfer-python==$VERSION"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --platform manylinux_2_28_x86_64 -d "$dest" apache-tvm-ffi cuda-python cuda-bindings \
  cuda-pathfinder nvidia-ml-py
(cd "$work" && unzip -q flashinfer_python-*.whl && rm flashinfer_python-*.whl &&
  { find flashinfer -path flashinfer/data -prune -o -type f -size -2000k -print
    (cd flashinfer/data && find include spdlog cutlass/include cutlass/tools/util/include \
       cccl csrc/nv_internal csrc/generated csrc/fused_moe -type f &&
       find csrc -maxdepth 1 -type f) |
      sed 's|^|flashinfer/data/|'; } > files &&
  tar -cf - -T files flashinfer_python-*.dist-info | xz -T0 -6 > flashinfer-trim.tar.xz)
mv "$work/flashinfer-trim.tar.xz" "$dest/"
rm -rf "$work"
du -sh "$dest"
