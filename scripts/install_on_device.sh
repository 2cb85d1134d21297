# Sourced by the GPU check scripts: the wheels carried in the ignored .whl/ (the
# device machine reaches no registry) and FlashInfer's trimmed package from .peers/flashinfer
# (scripts/flashinfer_peer.sh), then this project, editable; its log goes to $LOGS (else
# $OUT). A built flashinfer experts module carried in .fi_module/ (written by
# scripts/flashinfer_experts_check.sh) is installed as FlashInfer's AOT copy, checked against
# the sha256 packed beside it, so nothing is compiled; FI_MODULE says what became of it.
# Scripts started by one that installed already (scripts/lanes.sh) find
# TORCH_MOE_OPS_INSTALLED set and the rest in their environment, and install nothing.
export PYTHONUNBUFFERED=1
_install_packages() {
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  fi
  if [ -f .peers/flashinfer/flashinfer-trim.tar.xz ]; then  # scripts/flashinfer_peer.sh
    # Unpacked once per machine: a JIT build of an earlier call may be reading its sources.
    if [ ! -f /tmp/site/.flashinfer-unpacked ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .peers/flashinfer/*.whl
      tar -xJf .peers/flashinfer/flashinfer-trim.tar.xz -C /tmp/site
      touch /tmp/site/.flashinfer-unpacked
    fi
  fi
  python3 -m pip install -q --no-deps --no-build-isolation -e . >"${LOGS:-$OUT}/install.log" 2>&1 \
    || { cat "${LOGS:-$OUT}/install.log"; return 1; }
}
_install_fi_module() {  # prints what became of a carried module
  ls .fi_module/fi_module.tar.xz.part* >/dev/null 2>&1 || { echo "carried: none"; return; }
  local name aot_dir
  name=$(python3 -c "from torch_moe_ops.backends.flashinfer.cutlass_module import module_name
print(module_name())") && aot_dir=$(python3 -c "from flashinfer.jit import env
print(env.FLASHINFER_AOT_DIR)") || { echo "carried: not installed (flashinfer does not import)"; return; }
  mkdir -p "$aot_dir"
  if cat .fi_module/fi_module.tar.xz.part* | tar -xJ -C "$aot_dir" \
      && (cd "$aot_dir/$name" && sha256sum -c --quiet "$name.so.sha256"); then
    echo "carried: installed as $aot_dir/$name/$name.so"
  else
    rm -f "$aot_dir/$name/$name.so"
    echo "carried: unpacking or its checksum failed"
  fi
}
if [ -z "${TORCH_MOE_OPS_INSTALLED:-}" ]; then
  mkdir -p /tmp/site
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  _install_packages || exit 1
  FI_MODULE=$(_install_fi_module)
  export FI_MODULE TORCH_MOE_OPS_INSTALLED=1
fi
